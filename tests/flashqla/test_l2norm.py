"""The q/k L2 normalisation's Hopper kernels (flashqla/hopper/l2norm.py) against float64 autograd of
the reference definition (flashqla.reference.l2_normalize), with NaN-poisoned memory, row counts that
leave the last CTA partly empty, a row of zeros, and the worst row's error reported besides the
tensor's. (The op's use of them is checked through the op in test_hopper_backward.py and the hard
inputs.)"""
import pytest
import torch

from flashqla.reference import l2_normalize as reference_l2_normalize


def _rows(dtype, seed=0, tokens=40):
    generator = torch.Generator().manual_seed(seed)
    # norms from 0.01 to 10 per row, one row of zeros (eps keeps it finite)
    x = torch.randn(2, tokens, 3, 128, generator=generator, dtype=torch.float64)
    x = x * torch.logspace(-2, 1, tokens, dtype=torch.float64).view(1, tokens, 1, 1)
    x[0, 0, 0] = 0
    return x.to(dtype)


def _relative(ours, truth):
    """(relative L2 error over the tensor, worst over its rows of 128)."""
    difference, truth = (ours.double() - truth).reshape(-1, 128), truth.reshape(-1, 128)
    rows = difference.norm(dim=1) / truth.norm(dim=1).clamp_min(1e-30)
    return (difference.norm() / truth.norm()).item(), rows.max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [40, 2731], ids=["240_rows", "16386_rows"])
def test_hopper_kernels_match_float64_autograd(dtype, tokens):
    from flashqla.hopper.l2norm import l2_normalized
    from flashqla.hopper.l2norm import l2norm_backward
    from hopper_grid import poison_allocator

    x = _rows(torch.float64, seed=tokens, tokens=tokens).cuda().to(dtype)
    exact = x.double().requires_grad_()  # the float64 truth of the rounded input
    dy = torch.randn(exact.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                     dtype=torch.float64)
    outputs = []
    for _ in range(2):
        poison_allocator()
        y, rstd = l2_normalized(x)
        poison_allocator()
        dx = l2norm_backward(dy.to(dtype).reshape(-1, 128), x.reshape(-1, 128), rstd).view(x.shape)
        outputs.append((y, dx))
    reference = reference_l2_normalize(exact)
    reference.backward(dy)
    (y, dx), (y_again, dx_again) = outputs
    assert torch.equal(y, y_again) and torch.equal(dx, dx_again), "not bitwise deterministic"
    errors = {}
    for name, ours, truth in (("y", y, reference), ("dx", dx, exact.grad)):
        assert ours.dtype == dtype and torch.isfinite(ours).all(), f"{name}: NaN or inf (an unwritten row?)"
        errors[name] = _relative(ours, truth)
    report = "; ".join(f"{name} {tensor:.2e} (worst row {row:.2e})" for name, (tensor, row) in errors.items())
    print(report)
    # one rounding to bf16 (2^-8 relative) sets both; fp16 rounds 8x finer
    assert all(tensor <= 4e-3 and row <= 8e-3 for tensor, row in errors.values()), report


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 2, 3, 16])
def test_hopper_backward_sums_each_rows_group_of_gradients(dtype, group):
    """dy in bf16 with `group` rows per row of x (a head group's value heads, as the reverse walk writes them): dx is
    float64 autograd's for their sum; deterministic; every row written (partial last CTA, NaN-poisoned memory)."""
    from flashqla.hopper.l2norm import l2_normalized, l2norm_backward
    from hopper_grid import poison_allocator

    x = _rows(torch.float64, seed=group, tokens=333).cuda().to(dtype)
    exact = x.double().requires_grad_()
    dy = torch.randn(*x.shape[:-1], group, 128, generator=torch.Generator(device="cuda").manual_seed(2),
                     device="cuda", dtype=torch.float64).to(torch.bfloat16)
    _, rstd = l2_normalized(x)
    results = []
    for _ in range(2):
        poison_allocator()
        results.append(l2norm_backward(dy.reshape(-1, 128), x.reshape(-1, 128), rstd).view(x.shape))
    assert torch.equal(results[0], results[1]), "not bitwise deterministic"
    reference_l2_normalize(exact).backward(dy.double().sum(-2))
    dx = results[0]
    assert dx.dtype == dtype and torch.isfinite(dx).all()
    tensor, row = _relative(dx, exact.grad)
    assert tensor <= 4e-3 and row <= 8e-3, (tensor, row)


def test_backward_rejects_gradients_that_are_no_whole_group():
    from flashqla.hopper.l2norm import l2norm_backward

    with pytest.raises(ValueError, match="dy must have a whole number of rows per row of x"):
        l2norm_backward(torch.zeros(7, 128), torch.zeros(2, 128), torch.ones(2))
