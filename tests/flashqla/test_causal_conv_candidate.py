"""The candidate conv kernels (`causal_conv.CANDIDATES`: lanes channels a thread, depth tokens loaded
ahead), not yet run on a GPU and reachable only through `candidate=`: on the GPU against float64 and
the kernel (tools/device_session.sh `unverified`), and on the CPU bitwise against the kernel by running
both kernels' generated CUDA on the host (tests/flashqla/host_kernel.py). Once measured, the candidate
either replaces the kernel (and this file merges into test_causal_conv.py) or goes."""
import math
import shutil

import pytest
import torch

pytest.importorskip("tilelang")

from flashqla.conv import causal_conv1d_silu_torch  # noqa: E402
from flashqla.hopper import causal_conv  # noqa: E402
from flashqla.hopper.causal_conv import CANDIDATES, causal_conv1d_silu_hopper  # noqa: E402
from tests.flashqla.host_kernel import HostKernel, host_compiler  # noqa: E402
from tests.flashqla.hopper_grid import poison_allocator  # noqa: E402
from tests.flashqla.test_causal_conv import RAGGED, _inputs, _positions, _run, _worst_per_document  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", CANDIDATES, ids=[f"lanes{a}_depth{b}" for a, b in CANDIDATES])
@pytest.mark.parametrize("lengths, batch, channels", [(RAGGED, 1, 6144), ([2047], 3, 200), ([5000], 1, 130)],
                         ids=["ragged_6144", "batch3_200", "long_130"])
def test_candidate_matches_float64_autograd_and_the_kernel(lengths, batch, channels, candidate):
    """The candidate kernels (causal_conv.CANDIDATES) on the kernel test's bf16 inputs: the same bounds
    against float64, and no further from the kernel than a bf16 rounding; 130 channels split into
    pairs only, where wider lanes must refuse by name."""
    x, weight, dy = _inputs(lengths, channels, torch.bfloat16, batch=batch)
    flat_positions = _positions(lengths, x.device) if batch == 1 else torch.arange(sum(lengths), device=x.device)
    position = flat_positions.to(torch.int32).repeat(batch)
    if channels % candidate[0]:
        with pytest.raises(ValueError, match=f"candidate lanes={candidate[0]}: x has {channels} channels"):
            causal_conv1d_silu_hopper(x, weight, position, candidate=candidate)
        return

    def run(candidate):
        leaf, taps = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        y = causal_conv1d_silu_hopper(leaf, taps, position, candidate=candidate)
        y.backward(dy)
        return {"y": y.detach(), "dx": leaf.grad, "dw": taps.grad}

    poison_allocator()
    ours, kernel = run(candidate), run(None)
    exact = _run(x.double(), weight.double(), flat_positions if batch == 1 else None, dy.double(), "torch")
    for name in ("y", "dx", "dw"):
        assert torch.isfinite(ours[name]).all(), f"{name}: not finite (an unwritten output?)"
        error = ((ours[name].double() - exact[name]).norm() / exact[name].norm()).item()
        assert error <= 8e-3, f"{name}: relative error {error:.2e} over the tensor, expected <= 8e-3"
        apart = ((ours[name].double() - kernel[name].double()).norm() / kernel[name].double().norm()).item()
        assert apart <= 4e-3, f"{name}: {apart:.2e} from the kernel's, expected the same arithmetic"
        if name != "dw":
            worst = _worst_per_document(ours[name], exact[name], lengths)
            assert worst <= 1.6e-2, f"{name}: worst per-document relative error {worst:.2e}, expected <= 1.6e-2"


@pytest.mark.parametrize(
    "channels, candidate, message",
    [
        (130, (4, 2), r"candidate lanes=4: x has 130 channels at address 0x[0-9a-f]+, not whole 8-byte vectors"),
        (128, (3, 2), r"candidate=\(lanes=3, depth=2\): expected lanes a power of two with lanes \* 2 bytes <= 16"),
        (128, (16, 2), r"candidate=\(lanes=16, depth=2\): expected lanes a power of two"),
        (128, (4, 0), r"candidate=\(lanes=4, depth=0\): .* and depth >= 1"),
    ],
)
def test_bad_candidates_are_named_before_any_kernel(channels, candidate, message):
    x = torch.zeros(1, 8, channels, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        causal_conv1d_silu_hopper(x, torch.zeros(channels, 1, 4), torch.zeros(8, dtype=torch.int32), candidate=candidate)


# float32 candidates (a float32 vector is at most 4 lanes), and an odd depth for the ring's remainder
HOST_CANDIDATES = [c for c in CANDIDATES if c[0] <= 4] + [(1, 3)]


@pytest.mark.skipif(shutil.which("nvcc") is None or host_compiler() is None,
                    reason="needs nvcc (TileLang's CUDA source) and a host C++ compiler")
@pytest.mark.parametrize("candidate", HOST_CANDIDATES, ids=[f"lanes{a}_depth{b}" for a, b in HOST_CANDIDATES])
@pytest.mark.parametrize("lengths, channels", [(RAGGED, 1024), ([5, 0, 1], 256)], ids=["ragged_1024", "short_256"])
def test_candidate_is_bitwise_the_kernel_on_the_host(lengths, channels, candidate):
    """The float32 kernels' generated CUDA, run thread by thread on the CPU (tests/flashqla/host_kernel.py):
    the candidate's y, dx and per-block dw are bitwise the GPU-tested kernel's, which is within float32
    rounding of float64 torch. Fewer channels than a CTA's threads, empty and 1-token documents, a
    document across the backward's 256-token blocks."""
    lanes, depth = candidate
    generator = torch.Generator().manual_seed(sum(lengths) + channels + lanes)
    tokens = sum(lengths)
    x = torch.randn(tokens, channels, generator=generator)
    dy = torch.randn(tokens, channels, generator=generator)
    weight = torch.randn(channels, 4, generator=generator) * 0.5
    position = _positions(lengths, "cpu").to(torch.int32)
    groups = channels // lanes
    blocks = math.ceil(tokens / causal_conv.BACKWARD_TOKENS)
    forward_grid = math.ceil(tokens / causal_conv.FORWARD_TOKENS)
    outputs = {}
    # the kernel takes one channel a thread (its width argument `channels`), the candidate `lanes` (`groups`)
    for name, forward, backward, width_name, width in (
            ("kernel", causal_conv.compile_conv_forward("float32"), causal_conv.compile_conv_backward("float32"),
             "channels", channels),
            ("candidate", causal_conv.compile_conv_forward_lanes("float32", 4, lanes, depth),
             causal_conv.compile_conv_backward_lanes("float32", 4, lanes, depth), "groups", groups)):
        y, dx = torch.full_like(x, math.nan), torch.full_like(x, math.nan)
        dw_partial = torch.full((blocks, channels, 4), math.nan)
        columns = math.ceil(width / causal_conv._THREADS)
        HostKernel(forward.get_kernel_source())(
            (columns, forward_grid), x=x, weight=weight, position=position, y=y, num_tokens=tokens,
            **{width_name: width})
        HostKernel(backward.get_kernel_source())(
            (columns, blocks), x=x, weight=weight, position=position, dy=dy, dx=dx, dw_partial=dw_partial,
            num_blocks=blocks, num_tokens=tokens, **{width_name: width})
        outputs[name] = {"y": y, "dx": dx, "dw_partial": dw_partial}
    for label in ("y", "dx", "dw_partial"):
        assert torch.equal(outputs["candidate"][label], outputs["kernel"][label]), label
    leaf, taps = x.double().requires_grad_(), weight.double().view(channels, 1, 4).requires_grad_()
    exact = causal_conv1d_silu_torch(leaf[None], taps, position.long())
    exact.backward(dy.double()[None])
    for ours, truth in ((outputs["kernel"]["y"], exact[0]), (outputs["kernel"]["dx"], leaf.grad),
                        (outputs["kernel"]["dw_partial"].sum(0), taps.grad.view(channels, 4))):
        assert ((ours.double() - truth).norm() / truth.norm()).item() < 1e-6
