"""Inputs and error measures shared by the tests and the benchmark."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf when x has a NaN or Inf (so NaN never passes)."""
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def random_inputs(
    seq_lens: list[int] | None = None,
    batch: int = 1,
    seq_len: int | None = None,
    num_qk_heads: int = 2,
    num_v_heads: int = 4,
    head_k: int = 128,
    head_v: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    with_initial_state: bool = True,
    decay_scale: float = 1 / 16,
    seed: int = 0,
) -> dict:
    """Random op inputs like the anchors' benchmark: L2-normalised q/k, g = logsigmoid(randn) * decay_scale,
    beta = sigmoid(randn), float32 g/beta/state. `seq_lens` packs sequences (B = 1, cu_seqlens);
    otherwise `batch` x `seq_len`."""
    gen = torch.Generator().manual_seed(seed)
    if seq_lens is not None:
        batch, seq_len = 1, sum(seq_lens)
    num_states = len(seq_lens) if seq_lens is not None else batch

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(batch, seq_len, num_qk_heads, head_k), dim=-1)
    k = F.normalize(randn(batch, seq_len, num_qk_heads, head_k), dim=-1)
    v = randn(batch, seq_len, num_v_heads, head_v)
    g = F.logsigmoid(randn(batch, seq_len, num_v_heads)) * decay_scale
    beta = randn(batch, seq_len, num_v_heads).sigmoid()
    h0 = randn(num_states, num_v_heads, head_k, head_v) if with_initial_state else None
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(
        q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype),
        g=g.to(device, state_dtype), beta=beta.to(device, state_dtype),
        initial_state=None if h0 is None else h0.to(device, state_dtype),
        cu_seqlens=None,
    )
    if seq_lens is not None:
        bounds = torch.tensor([0, *seq_lens]).cumsum(0)
        out["cu_seqlens"] = bounds.to(device=device, dtype=torch.int32)
    return out
