"""CI (no GPU): every TileLang kernel lowers and compiles for sm_90a."""
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")

if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc to compile the sm_90a kernels", allow_module_level=True)

from flashqla.hopper.compile_check import COMPILE_CHECKS  # noqa: E402


@pytest.mark.parametrize("name,build", COMPILE_CHECKS, ids=[name for name, _ in COMPILE_CHECKS])
def test_kernel_compiles_for_sm90a(name, build):
    kernel = build()
    source = kernel.get_kernel_source()
    assert "__global__" in source, f"{name}: no CUDA kernel in the generated source"


def test_fused_forward_uses_hopper_instructions():
    """The fused forward must use wgmma and TMA loads, not a slower fallback."""
    from flashqla.hopper.fused_forward import compile_fused_forward

    source = compile_fused_forward(64).get_kernel_source()
    assert "wgmma" in source and "tma_load" in source
