"""The in-kernel L2 normalisation of q and k (`use_qk_l2norm_in_kernel=True`) for the kernel backends.

y = x * r with r = (sum(x^2) + eps)^(-1/2) over the last dim, computed in float32 and rounded
once; its gradient dx = r * (dy - y * sum(y * dy)). As plain autograd ops on bf16 tensors this
is about a dozen memory-bound passes (forward and backward) and rounds the sum of squares to
bf16; here it is one pass each way, compiled by torch.compile on CUDA (eager elsewhere), and the
backward reads the normalised y, which the kernels' autograd Function keeps anyway, plus r
(4 bytes per row).
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


_compiled_forward = torch.compile(_forward, dynamic=True)
_compiled_backward = torch.compile(_backward, dynamic=True)


def _on_cuda(x: torch.Tensor) -> bool:
    # float64 runs are reference checks: eager, as the model's fused chains do
    return x.is_cuda and x.dtype != torch.float64


class L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = (_compiled_forward if _on_cuda(x) else _forward)(x, eps)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return (_compiled_backward if _on_cuda(dy) else _backward)(dy.contiguous(), y, rstd), None


def l2_normalize(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in one fused pass forward and backward."""
    return L2Normalize.apply(x, eps)
