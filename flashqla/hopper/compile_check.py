"""Build every Hopper kernel for sm_90a without a GPU (CI runs this through tests/flashqla/test_hopper_compile.py).

Each entry is (name, zero-argument builder returning a compiled kernel); one representative
specialisation per kernel keeps the total compile time modest. The backward kernels register
theirs as COMPILE_CHECKS in flashqla/hopper/backward.py.
"""

import importlib

from flashqla.hopper.chunk_states import compile_chunk_states
from flashqla.hopper.cumsum import compile_cumsum
from flashqla.hopper.fused_forward import compile_fused_forward
from flashqla.hopper.grouped_products import compile_grouped_products
from flashqla.hopper.inverse import compile_gated_products, compile_inverse

FORWARD_COMPILE_CHECKS = [
    ("chunk_local_cumsum", lambda: compile_cumsum()),
    ("gate_free_inverse", lambda: compile_inverse()),
    ("gated_products", lambda: compile_gated_products()),
    ("fused_forward", lambda: compile_fused_forward(64)),
    ("fused_forward_keeping_states", lambda: compile_fused_forward(64, store_chunk_states=True)),
    ("chunk_states", lambda: compile_chunk_states(64, with_transition=True)),
    ("grouped_products", lambda: compile_grouped_products()),
    ("grouped_products_with_inverse", lambda: compile_grouped_products(write_inverse=True)),
]


def all_compile_checks():
    """Forward checks plus the backward helper's, when its module is present."""
    checks = list(FORWARD_COMPILE_CHECKS)
    try:
        backward = importlib.import_module("flashqla.hopper.backward")
    except ModuleNotFoundError as error:
        if error.name != "flashqla.hopper.backward":
            raise
        return checks
    checks.extend(getattr(backward, "COMPILE_CHECKS", []))
    return checks


def compile_all() -> list[str]:
    """Compile every kernel for sm_90a; returns the names built. Raises on the first failure."""
    built = []
    for name, build in all_compile_checks():
        kernel = build()
        if "__global__" not in kernel.get_kernel_source():
            raise RuntimeError(f"kernel {name} produced no CUDA source")
        built.append(name)
    return built


if __name__ == "__main__":
    for built_name in compile_all():
        print("built", built_name)
