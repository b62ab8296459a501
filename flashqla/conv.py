"""The GDN layer's short causal depthwise conv + SiLU over packed documents (what Qwen3.5 and FLA
run on q, k, v before the gated delta rule), with a Hopper kernel and a torch path.

    causal_conv1d_silu(x, weight, position_in_doc, backend="auto")

x [B, T, C]; weight [C, 1, K] (HF's `nn.Conv1d(groups=C)` layout) or [C, K]; position_in_doc [T]
integer: each token's position in its document (0 at every document start; `arange(T)` when every
row is one document). A tap never reaches back past the start of its token's document.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashqla.backends import hopper_unavailable

BACKENDS = ("auto", "tilelang", "torch")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def causal_conv1d_silu_torch(x: torch.Tensor, weight: torch.Tensor, position_in_doc: torch.Tensor | None) -> torch.Tensor:
    """The op as a sum of K shifted copies, in float32 (float64 for float64 x): any device, and the
    reference of the kernel's tests. position_in_doc None: every row is one document."""
    kernel_size = weight.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_float, taps = x.to(dtype), weight.reshape(weight.shape[0], kernel_size).to(dtype)
    out = x_float * taps[:, kernel_size - 1]
    for shift in range(1, kernel_size):
        shifted = F.pad(x_float, (0, 0, shift, 0))[:, : x.shape[1]]
        if position_in_doc is not None:
            shifted = shifted * (position_in_doc >= shift).unsqueeze(-1)
        out = out + shifted * taps[:, kernel_size - 1 - shift]
    return F.silu(out).to(x.dtype)


def kernel_unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the Hopper kernel cannot take this x, or None."""
    reason = hopper_unavailable(x.device)
    if reason is None and x.dtype not in KERNEL_DTYPES:
        reason = f"needs x in {[str(d).removeprefix('torch.') for d in KERNEL_DTYPES]}, got {x.dtype}"
    return reason


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, position_in_doc: torch.Tensor | None = None,
                       backend: str = "auto") -> torch.Tensor:
    """silu(causal depthwise conv of x over time), restarting at every document (module docstring).

    backend "tilelang": the Hopper kernel (flashqla/hopper/causal_conv.py; keeps only x for the
    backward); "torch": causal_conv1d_silu_torch; "auto": the kernel where it runs, else torch."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    if weight.shape[0] != x.shape[-1] or weight.dim() not in (2, 3) or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"weight must be [C={x.shape[-1]}, 1, K] or [C, K], got shape {tuple(weight.shape)}")
    if position_in_doc is not None and tuple(position_in_doc.shape) != (x.shape[1],):
        raise ValueError(f"position_in_doc must be [T={x.shape[1]}], got shape {tuple(position_in_doc.shape)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    reason = None if backend == "torch" else kernel_unavailable_reason(x)
    if backend == "tilelang" and reason is not None:
        raise ValueError(f"backend='tilelang' {reason}")
    if backend == "torch" or reason is not None:
        return causal_conv1d_silu_torch(x, weight, position_in_doc)
    from flashqla.hopper.causal_conv import causal_conv1d_silu_hopper

    batch, length = x.shape[:2]
    if position_in_doc is None:
        position_in_doc = torch.arange(length, device=x.device)
    position = position_in_doc.to(device=x.device, dtype=torch.int32).repeat(batch)
    return causal_conv1d_silu_hopper(x, weight, position)
