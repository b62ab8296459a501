"""The forward's entry: o and the final state from the kernels, in the order they run.

1. `chunk_plan.py`: the chunks, and the pieces each CTA walks (cached per cu_seqlens).
2. `inverse.py`: gamma (the chunk-local cumsum of g) and the gate-free inverse A~ of every chunk and
   value head, in parallel.
3. `walk_bounds.py`: where each (piece, head) starts its decay-truncated warm-up (docs/gdn-math.md §4).
4. `fused_forward.py`: the sequential walk over the chunks, building Ab and P on chip: o, the final
   state and, with `keep_for_backward`, the state entering every chunk.
"""
from typing import NamedTuple

import torch

from flashqla.hopper.chunk_plan import ForwardPlan, device_sm_count, flat_cu_seqlens, plan_forward
from flashqla.hopper.common import DEFAULT_LOG_DECAY_THRESHOLD, unsupported_inputs
from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK, fused_forward
from flashqla.hopper.inverse import gamma_and_inverse
from flashqla.hopper.walk_bounds import walk_bounds


class KeptForward(NamedTuple):
    """What the forward can hand the backward so that it recomputes nothing (`forward(...,
    keep_for_backward=True)`): T * Hv * (128 + 4) bytes plus one state per chunk and value head (T * Hv * 512
    bytes) in the inputs' dtype. Without the chunk states (keep_chunk_states=False) the backward walks the
    chunks again for them (`walk_chunks`). Ab and P are never kept: the reverse walk makes them on chip."""

    gamma: torch.Tensor                # float32 [T, Hv]: chunk-local cumsum of g
    inverse: torch.Tensor              # [T, Hv, 64]: A~
    chunk_states: torch.Tensor | None  # [num_chunks, Hv, 128, 128]: the state entering every chunk


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            log_decay_threshold: float = DEFAULT_LOG_DECAY_THRESHOLD, cu_seqlens_host: list[int] | None = None,
            keep_for_backward: bool = False, keep_chunk_states: bool = True, normalize_qk: bool = False,
            ragged_cuts: bool = False):
    """(o, final_state or None) for q, k [B, T, Hqk, 128], v [B, T, Hv, 128], g, beta [B, T, Hv], with a
    KeptForward next when keep_for_backward and (q_rstd, k_rstd) last when normalize_qk.

    log_decay_threshold: how far a piece of a split sequence may truncate the history it rebuilds
    its entering state from (walk_bounds.py); -inf never truncates.
    cu_seqlens_host: cu_seqlens as a Python list when the caller has already read it back; saves
    the forward's only device->host sync.
    keep_for_backward: also return a KeptForward, which `backward.backward(..., kept=...)` takes
    instead of recomputing the inverse and the chunk states; keep_chunk_states=False leaves the states out of
    it (T * Hv * 512 bytes).
    normalize_qk: the recurrence of L2-normalised q and k (use_qk_l2norm_in_kernel): the inverse's kernel
    makes the norm's r (float32 [B * T * Hqk] each, returned for the backward) and the kernels apply it to q
    and k on chip; q^ and k^ are never written.
    ragged_cuts (candidate, not passed by the op): the plan may also cut sequences into pieces of S chunks and a
    shorter last one (chunk_plan._piece_rows); the backward must be given the same.
    """
    reason = unsupported_inputs(q, v)
    if reason is not None:
        raise ValueError(f"flashqla.hopper.forward {reason}")
    batch_size, seq_len, num_qk_heads, head_dim = q.shape
    num_v_heads = v.shape[2]
    num_tokens = batch_size * seq_len
    if cu_seqlens is None:
        cu_seqlens = flat_cu_seqlens(batch_size, seq_len, q.device)
        cu_seqlens_host = [b * seq_len for b in range(batch_size + 1)]
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    if scale is None:
        scale = head_dim ** -0.5

    q_flat = q.reshape(num_tokens, num_qk_heads, head_dim).contiguous()
    k_flat = k.reshape(num_tokens, num_qk_heads, head_dim).contiguous()
    v_flat = v.reshape(num_tokens, num_v_heads, head_dim).contiguous()
    beta_flat = beta.reshape(num_tokens, num_v_heads).contiguous()
    if beta_flat.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        beta_flat = beta_flat.float()
    if g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        g = g.float()

    plan = plan_forward(cu_seqlens, num_v_heads, head_dim, device_sm_count(q.device), MAX_VALUE_BLOCK,
                        host_bounds=cu_seqlens_host, ragged_cuts=ragged_cuts)
    gamma, inverse, *rstds = gamma_and_inverse(
        k_flat, g.reshape(num_tokens, num_v_heads).contiguous(), beta_flat, plan.chunk_bounds,
        normalize_q=q_flat if normalize_qk else None)
    rstds = rstds[0] if normalize_qk else None
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    o, final_state, chunk_states = walk_chunks(
        q_flat, k_flat, v_flat, gamma, beta_flat, inverse, scale, h0, cu_seqlens, plan, log_decay_threshold,
        store_chunk_states=keep_for_backward and keep_chunk_states, rstds=rstds)
    o = o.view(batch_size, seq_len, num_v_heads, head_dim)
    final_state = final_state if output_final_state else None
    kept = [KeptForward(gamma, inverse, chunk_states)] if keep_for_backward else []
    flat_rstds = [tuple(r.view(-1) for r in rstds)] if normalize_qk else []
    return o, final_state, *kept, *flat_rstds


def walk_chunks(q_flat, k_flat, v_flat, gamma, beta_flat, inverse, scale, h0, cu_seqlens, plan: ForwardPlan,
                log_decay_threshold: float = DEFAULT_LOG_DECAY_THRESHOLD, store_chunk_states: bool = False,
                rstds: tuple | None = None):
    """Steps 3-4 on flattened inputs ([T, H, 128]; h0 float32 or None): the warm-up starts of the
    plan's pieces, then the fused walk: (o, final_state, the chunk states or None unless stored). rstds: (q_rstd, k_rstd) [T, Hqk] when q and k are the L2 norm's inputs."""
    walk = walk_bounds(gamma, plan.pieces, cu_seqlens, ahead=False, log_decay_threshold=log_decay_threshold)
    return fused_forward(q_flat, k_flat, v_flat, gamma, beta_flat, inverse, scale, h0, cu_seqlens, plan.value_block,
                         plan.pieces, walk, store_chunk_states=store_chunk_states,
                         offsets=plan.chunk_offsets, num_chunks=plan.chunk_index.shape[0], rstds=rstds)
