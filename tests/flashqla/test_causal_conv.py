"""The GDN layer's causal conv + SiLU (flashqla/conv.py): the Hopper kernel against float64 autograd of
the torch definition, on packed ragged documents, at every vector width it picks (4, 2 and 1 channels a
thread); on the CPU the float32 kernels' generated CUDA run on the host (tests/flashqla/host_kernel.py);
and the op's argument checks."""
import math
import shutil

import pytest
import torch

from flashqla.conv import causal_conv1d_silu, causal_conv1d_silu_torch
from tests.flashqla.hopper_grid import poison_allocator
from tests.flashqla.host_kernel import HostKernel, host_compiler

# empty and one-token documents, documents shorter than the kernel, a block boundary (256 tokens)
# inside a document, and one longer than a token block of the backward
RAGGED = [1, 300, 0, 2, 3, 257, 1, 0, 1500, 64]


def _positions(lengths, device):
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def _inputs(lengths, channels, dtype, batch=1, seed=0, device="cuda"):
    generator = torch.Generator().manual_seed(seed)
    length = sum(lengths)
    x = torch.randn(batch, length, channels, generator=generator, dtype=torch.float64)
    # channel scales from 0.01 to 10 so that SiLU meets its flat, curved and linear parts
    x = x * torch.logspace(-2, 1, channels, dtype=torch.float64)
    weight = torch.randn(channels, 1, 4, generator=generator, dtype=torch.float64) * 0.5
    dy = torch.randn(batch, length, channels, generator=generator, dtype=torch.float64)
    return x.to(device, dtype), weight.to(device, torch.float32), dy.to(device, dtype)


def _run(x, weight, position, dy, backend):
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    y = causal_conv1d_silu(x, weight, position, backend=backend)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": weight.grad}


def _worst_per_document(ours, truth, lengths):
    """max over documents of the relative error of one document's slice (tokens on dim 1)."""
    worst = 0.0
    for part, ref in zip(ours.split(lengths, dim=1), truth.split(lengths, dim=1)):
        if part.numel():
            worst = max(worst, ((part.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item())
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 8e-3), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lengths, batch, channels",
                         [(RAGGED, 1, 6144), ([2047], 3, 200), ([5000], 1, 130), (RAGGED, 1, 129)],
                         ids=["ragged_6144", "batch3_200", "long_130_two_lanes", "ragged_129_one_lane"])
def test_kernel_matches_float64_autograd(lengths, batch, channels, dtype, bound):
    x, weight, dy = _inputs(lengths, channels, dtype, batch=batch)
    position = _positions(lengths, x.device) if batch == 1 else None
    poison_allocator()
    ours = _run(x, weight, position, dy, "tilelang")
    exact = _run(x.double(), weight.double(), position, dy.double(), "torch")
    for name in ("y", "dx", "dw"):
        assert ours[name].dtype == (dtype if name != "dw" else torch.float32), name
        assert torch.isfinite(ours[name]).all(), f"{name}: not finite (an unwritten output?)"
        error = ((ours[name].double() - exact[name]).norm() / exact[name].norm()).item()
        assert error <= bound, f"{name}: relative error {error:.2e} over the tensor, expected <= {bound:.0e}"
        if name != "dw":
            worst = _worst_per_document(ours[name], exact[name], lengths)
            assert worst <= 2 * bound, f"{name}: worst per-document relative error {worst:.2e}, expected <= {2 * bound:.0e}"


@pytest.mark.gpu
def test_kernel_is_deterministic():
    x, weight, dy = _inputs(RAGGED, 6144, torch.bfloat16, seed=3)
    position = _positions(RAGGED, x.device)
    first, second = _run(x, weight, position, dy, "tilelang"), _run(x, weight, position, dy, "tilelang")
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.gpu
def test_documents_do_not_see_each_other_in_the_kernel():
    """Each document alone, through the kernel, equals its slice of the packed run (bitwise: the
    kernel's sums do not depend on what lies outside the document)."""
    lengths = [3, 700, 1, 260]
    x, weight, dy = _inputs(lengths, 256, torch.bfloat16, seed=4)
    packed = _run(x, weight, _positions(lengths, x.device), dy, "tilelang")
    start = 0
    for n in lengths:
        alone = _run(x[:, start:start + n], weight, None, dy[:, start:start + n], "tilelang")
        assert torch.equal(alone["y"], packed["y"][:, start:start + n])
        assert torch.equal(alone["dx"], packed["dx"][:, start:start + n])
        start += n


@pytest.mark.gpu
def test_outputs_do_not_depend_on_the_vector_width(monkeypatch):
    """x starting 0, 2 and 1 bf16 elements past a 16-byte boundary runs the kernels at 4, 2 and 1
    channels a thread (causal_conv.lanes_for; checked on the widths the compile calls name); y, dx
    and dw are bitwise the same: every channel sees the same arithmetic."""
    from flashqla.hopper import causal_conv

    widths = []
    for name in ("compile_conv_forward", "compile_conv_backward"):
        original = getattr(causal_conv, name)
        monkeypatch.setattr(causal_conv, name, lambda *args, _original=original, **kwargs:
                            widths.append(args[2]) or _original(*args, **kwargs))
    x, weight, dy = _inputs(RAGGED, 512, torch.bfloat16, seed=5)
    position = _positions(RAGGED, x.device)
    runs = []
    for offset, lanes in ((0, 4), (2, 2), (1, 1)):
        storage = torch.empty(x.numel() + offset, dtype=x.dtype, device=x.device)
        shifted = storage[offset:].view(x.shape)  # a view off the vector boundary, passed as it is
        shifted.copy_(x)
        leaf, taps = shifted.requires_grad_(), weight.detach().clone().requires_grad_()
        widths.clear()
        y = causal_conv1d_silu(leaf, taps, position, backend="tilelang")
        y.backward(dy)
        assert widths == [lanes, lanes], f"offset {offset}: kernels ran at {widths} lanes, expected {lanes}"
        runs.append({"y": y.detach(), "dx": leaf.grad, "dw": taps.grad})
    for name in runs[0]:
        for other in runs[1:]:
            assert torch.equal(runs[0][name], other[name]), name


@pytest.mark.skipif(shutil.which("nvcc") is None or host_compiler() is None,
                    reason="needs nvcc (TileLang's CUDA source) and a host C++ compiler")
@pytest.mark.parametrize("lengths, channels", [(RAGGED, 1024), ([5, 0, 1], 256)], ids=["ragged_1024", "short_256"])
def test_kernel_widths_are_bitwise_one_another_on_the_host(lengths, channels):
    """The float32 kernels' generated CUDA at 4, 2 and 1 lanes, run thread by thread on the CPU: y, dx and
    the per-block dw bitwise the same at every width and within float32 rounding of float64 torch. Fewer
    channels than a CTA's threads, empty and 1-token documents, a document across the backward's blocks;
    the backward's 64-token blocks give the same dx."""
    pytest.importorskip("tilelang")
    from flashqla.hopper import causal_conv

    generator = torch.Generator().manual_seed(sum(lengths) + channels)
    tokens = sum(lengths)
    x = torch.randn(tokens, channels, generator=generator)
    dy = torch.randn(tokens, channels, generator=generator)
    weight = torch.randn(channels, 4, generator=generator) * 0.5
    position = _positions(lengths, "cpu").to(torch.int32)
    forward_grid = math.ceil(tokens / causal_conv.FORWARD_TOKENS)

    def columns(lanes):
        return math.ceil(channels // lanes / causal_conv._THREADS)

    def host_backward(lanes, block_tokens=causal_conv.BACKWARD_TOKENS):
        blocks = math.ceil(tokens / block_tokens)
        dx, dw_partial = torch.full_like(x, math.nan), torch.full((blocks, channels, 4), math.nan)
        HostKernel(causal_conv.compile_conv_backward("float32", 4, lanes, block_tokens).get_kernel_source())(
            (columns(lanes), blocks), x=x, weight=weight, position=position, dy=dy, dx=dx, dw_partial=dw_partial,
            num_blocks=blocks, num_tokens=tokens, groups=channels // lanes)
        return dx, dw_partial

    outputs = {}
    for lanes in (4, 2, 1):
        y = torch.full_like(x, math.nan)
        HostKernel(causal_conv.compile_conv_forward("float32", 4, lanes).get_kernel_source())(
            (columns(lanes), forward_grid), x=x, weight=weight, position=position, y=y, num_tokens=tokens,
            groups=channels // lanes)
        dx, dw_partial = host_backward(lanes)
        outputs[lanes] = {"y": y, "dx": dx, "dw_partial": dw_partial}
    for lanes in (2, 1):
        for label in ("y", "dx", "dw_partial"):
            assert torch.equal(outputs[lanes][label], outputs[4][label]), f"{label} at {lanes} lanes"
    # shorter token blocks in the backward (bench --compare conv): the same dx, dw regrouped
    dx, dw_partial = host_backward(4, block_tokens=64)
    assert torch.equal(dx, outputs[4]["dx"])
    short_dw, dw = dw_partial.sum(0).double(), outputs[4]["dw_partial"].sum(0).double()
    assert ((short_dw - dw).norm() / dw.norm()).item() < 1e-6
    leaf, taps = x.double().requires_grad_(), weight.double().view(channels, 1, 4).requires_grad_()
    exact = causal_conv1d_silu_torch(leaf[None], taps, position.long())
    exact.backward(dy.double()[None])
    for ours, truth in ((outputs[4]["y"], exact[0]), (outputs[4]["dx"], leaf.grad),
                        (outputs[4]["dw_partial"].sum(0), taps.grad.view(channels, 4))):
        assert ((ours.double() - truth).norm() / truth.norm()).item() < 1e-6


def test_torch_path_restarts_at_documents_and_matches_float64_gradcheck():
    lengths = [2, 1, 5]
    x, weight, _ = _inputs(lengths, 3, torch.float64, device="cpu")
    position = _positions(lengths, "cpu")
    x.requires_grad_()
    weight = weight.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: causal_conv1d_silu_torch(a, w, position), (x, weight))
    whole = causal_conv1d_silu_torch(x, weight, position)
    alone = [causal_conv1d_silu_torch(part, weight, None) for part in x.split(lengths, dim=1)]
    # a document that sees its neighbour is off by O(1); float64 ops over another length may take
    # another vector/scalar path and round 1 ulp apart (seen on a Xeon: 5.6e-17)
    torch.testing.assert_close(whole, torch.cat(alone, dim=1), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize(
    "x_shape, weight_shape, position_shape, backend, message",
    [
        ((4, 3), (3, 1, 4), None, "auto", r"x must be \[B, T, C\], got shape \(4, 3\)"),
        ((1, 4, 3), (5, 1, 4), None, "auto", r"weight must be \[C=3, 1, K\] or \[C, K\], got shape \(5, 1, 4\)"),
        ((1, 4, 3), (3, 1, 4), (5,), "auto", r"position_in_doc must be \[T=4\], got shape \(5,\)"),
        ((1, 4, 3), (3, 1, 4), None, "cuda", r"backend must be one of \('auto', 'tilelang', 'torch'\), got 'cuda'"),
        ((1, 4, 3), (3, 1, 4), None, "tilelang", r"backend='tilelang' needs a CUDA GPU, got device cpu"),
    ],
)
def test_bad_arguments_are_named(x_shape, weight_shape, position_shape, backend, message):
    position = None if position_shape is None else torch.zeros(position_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        causal_conv1d_silu(torch.zeros(x_shape), torch.zeros(weight_shape), position, backend=backend)
