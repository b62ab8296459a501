"""The fused q/k L2 normalisation of the kernel backends (flashqla/l2norm.py) against autograd of
the reference definition (flashqla.reference.l2_normalize). Its compiled CUDA path runs in the
GPU tests through use_qk_l2norm_in_kernel (tests/flashqla/test_hopper_hard_inputs.py)."""
import pytest
import torch

from flashqla.l2norm import l2_normalize
from flashqla.reference import l2_normalize as reference_l2_normalize


def _rows(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # norms from 0.01 to 10 per row, one row of zeros (eps keeps it finite)
    x = torch.randn(2, 40, 3, 128, generator=generator, dtype=torch.float64)
    x = x * torch.logspace(-2, 1, 40, dtype=torch.float64).view(1, 40, 1, 1)
    x[0, 0, 0] = 0
    return x.to(dtype)


def test_gradient_is_exact_in_float64():
    x = _rows(torch.float64)[:, :6, :, :16].clone().requires_grad_()
    assert torch.autograd.gradcheck(l2_normalize, (x,))


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
def test_matches_float64_autograd_of_the_definition(dtype, bound):
    x = _rows(dtype).requires_grad_()
    exact = x.detach().double().requires_grad_()
    dy = torch.randn(exact.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = l2_normalize(x)
    y.backward(dy.to(dtype))
    reference = reference_l2_normalize(exact)
    reference.backward(dy)
    for name, ours, truth in (("y", y, reference), ("dx", x.grad, exact.grad)):
        assert ours.dtype == dtype and torch.isfinite(ours).all(), name
        error = ((ours.double() - truth).norm() / truth.norm()).item()
        assert error <= bound, f"{name}: relative error {error:.2e} in {dtype}, expected <= {bound:.0e}"
