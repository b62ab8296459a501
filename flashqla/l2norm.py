"""The in-kernel L2 normalisation of q and k (`use_qk_l2norm_in_kernel=True`) for the kernel backends.

y = x * r with r = (sum(x^2) + eps)^(-1/2) over the last dim, computed in float32 and rounded
once; its gradient dx = r * (dy - y * sum(y * dy)). The backward reads the normalised y, which the
kernels' autograd Function keeps anyway, plus r (4 bytes per row). On Hopper, for bf16 / fp16 rows
of 128, one TileLang kernel each way (flashqla/hopper/l2norm.py): one read of x and one write of y
forward, two reads and one write backward. Elsewhere (float32, float64 reference runs, CPU) the
same math in torch ops.
"""
from __future__ import annotations

import torch

EPS = 1e-6  # as HF Qwen3.5's torch path and FLA's kernels


def _forward(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_wide = x.to(dtype)
    rstd = torch.rsqrt((x_wide * x_wide).sum(dim=-1, keepdim=True) + eps)
    return (x_wide * rstd).to(x.dtype), rstd


def _backward(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    y_wide, dy_wide = y.to(rstd.dtype), dy.to(rstd.dtype)
    return (rstd * (dy_wide - y_wide * (y_wide * dy_wide).sum(dim=-1, keepdim=True))).to(dy.dtype)


def _runs_the_kernel(x: torch.Tensor) -> bool:
    """Whether the Hopper kernels take x: the device and the rows the GDN kernels take (q's checks)."""
    from flashqla.backends import hopper_unavailable
    from flashqla.hopper.common import unsupported_inputs

    return hopper_unavailable(x.device) is None and unsupported_inputs(x, x) is None


class L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        ctx.kernel = _runs_the_kernel(x)
        if ctx.kernel:
            from flashqla.hopper.l2norm import l2norm_forward

            y, rstd = l2norm_forward(x.reshape(-1, x.shape[-1]).contiguous(), eps)
            y = y.view(x.shape)
        else:
            y, rstd = _forward(x, eps)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        if not ctx.kernel:
            return _backward(dy, y, rstd), None
        from flashqla.hopper.l2norm import l2norm_backward

        width = y.shape[-1]
        dx = l2norm_backward(dy.reshape(-1, width).contiguous(), y.reshape(-1, width), rstd)
        return dx.view(dy.shape), None


def l2_normalize(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (module docstring)."""
    return L2Normalize.apply(x, eps)
