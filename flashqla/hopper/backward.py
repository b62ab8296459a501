"""The backward's entry: the gradients of (o, final state), from the kernels in the order they run.

1. Recompute what the forward did not keep: gamma (cumsum.py), the gate-free inverse A~
   (inverse.py), Ab and P (gated_products.py) and the bf16 state entering every chunk
   (chunk_states.py). With the forward's `KeptForward` none of this runs.
2. Walk the chunks in reverse for the state gradient leaving every chunk, and dh0
   (backward_state_grads.py; docs/gdn-math.md §3.1): the only sequential part.
3. Every chunk in parallel: dq, dk, dv, dg, dbeta (backward_chunk_grads.py; §3.2-3.3).
dq and dk come per value head and are summed over each head group in torch, which keeps the
result deterministic (no atomics).
"""

import torch

from flashqla.hopper.backward_chunk_grads import chunk_gradients
from flashqla.hopper.backward_state_grads import state_gradients
from flashqla.hopper.chunk_plan import device_sm_count, flat_cu_seqlens, plan_forward, value_block_size, walk_ends
from flashqla.hopper.chunk_states import chunk_states
from flashqla.hopper.common import DEFAULT_LOG_DECAY_THRESHOLD, HEAD_DIM, unsupported_inputs
from flashqla.hopper.cumsum import chunk_local_cumsum
from flashqla.hopper.forward import KeptForward
from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK as FORWARD_MAX_VALUE_BLOCK
from flashqla.hopper.gated_products import gated_products
from flashqla.hopper.inverse import gate_free_inverse

# Widest V block of the sequential walks: narrower blocks give more CTAs on the critical path.
MAX_VALUE_BLOCK = 64


def backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, cu_seqlens_host: list[int] | None = None,
             kept: KeptForward | None = None, state_grads_in_pieces: bool = False):
    """Gradients of (o, final_state) for inputs as given to `forward.forward`.

    q, k: [B, T, Hqk, 128]; v, do: [B, T, Hv, 128]; g, beta: [B, T, Hv]; initial_state, dht:
    [N, Hv, 128, 128] or None; cu_seqlens: int [N + 1] (B = 1) or None.
    Returns (dq, dk, dv, dg, dbeta, dh0): dq, dk, dv in q's dtype and shape (dq, dk summed over each
    value-head group); dg, dbeta float32 [B, T, Hv]; dh0 float32 [N, Hv, 128, 128], also when
    there is no initial state (the gradient a zero initial state would get).
    cu_seqlens_host: cu_seqlens as a list when the caller holds it (the forward's plan is then
    reused from its cache with no device->host read).
    kept: what `forward.forward(..., keep_for_backward=True)` returned for these inputs; everything
    in it is recomputed when None.
    state_grads_in_pieces: walk the state gradients of sequences the forward plan cut in the same
    pieces, each from a decay-truncated warm-up after its end (chunk_plan.walk_ends,
    docs/gdn-math.md §4), instead of one CTA per whole sequence. Not yet run on a GPU: only the
    bench and tests/flashqla/test_hopper_backward_pieces.py ask for it, never the public op.
    """
    reason = unsupported_inputs(q, v)
    if reason is not None:
        raise ValueError(f"flashqla.hopper.backward {reason}")
    batch_size, seq_len, num_qk_heads, _ = q.shape
    num_v_heads = v.shape[2]
    group = num_v_heads // num_qk_heads
    num_tokens = batch_size * seq_len
    device = q.device
    if cu_seqlens is None:
        cu_seqlens = flat_cu_seqlens(batch_size, seq_len, device)
        cu_seqlens_host = [b * seq_len for b in range(batch_size + 1)]
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    num_sequences = cu_seqlens.numel() - 1
    sm_count = device_sm_count(device)
    if cu_seqlens_host is None:
        cu_seqlens_host = cu_seqlens.tolist()
    # The forward's plan, from its cache (same key as the forward's): chunk index and offsets.
    plan = plan_forward(cu_seqlens, num_v_heads, HEAD_DIM, sm_count, FORWARD_MAX_VALUE_BLOCK,
                        host_bounds=cu_seqlens_host)

    # The kernels read bf16 operands; float16 inputs are converted once here.
    def flat(x, heads):
        return x.reshape(num_tokens, heads, HEAD_DIM).to(torch.bfloat16).contiguous()

    q_flat, k_flat = flat(q, num_qk_heads), flat(k, num_qk_heads)
    v_flat, do_flat = flat(v, num_v_heads), flat(do, num_v_heads)
    g_flat = g.reshape(num_tokens, num_v_heads).to(torch.float32).contiguous()
    beta_flat = beta.reshape(num_tokens, num_v_heads).to(torch.float32).contiguous()

    chunk_index, offsets = plan.chunk_index, plan.chunk_offsets
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    busy_sequences = max(sum(b > a for a, b in zip(cu_seqlens_host, cu_seqlens_host[1:])), 1)
    value_block = value_block_size(busy_sequences, num_v_heads, HEAD_DIM, sm_count, MAX_VALUE_BLOCK)

    # What the forward kept is taken as is (float16 inputs kept float16: the kernels here read bf16);
    # the rest is recomputed. A~ can be missing from what was kept (per-value-head products kernel).
    if kept is not None:
        gamma = kept.gamma
    else:
        gamma = chunk_local_cumsum(g_flat.unsqueeze(0), cu_seqlens, chunk_index=chunk_index)
        gamma = gamma.view(num_tokens, num_v_heads)
    if kept is not None and kept.inverse is not None:
        inverse = kept.inverse.to(torch.bfloat16)
    else:
        inverse = gate_free_inverse(k_flat.unsqueeze(0), beta_flat.unsqueeze(0), cu_seqlens, chunk_index=chunk_index)
        inverse = inverse.view(num_tokens, num_v_heads, -1)
    if kept is not None:
        gated_inverse, scores, states = (x.to(torch.bfloat16)
                                         for x in (kept.gated_inverse, kept.scores, kept.chunk_states))
    else:
        gated_inverse, scores, _ = gated_products(q_flat, k_flat, gamma, beta_flat, scale, cu_seqlens, chunk_index)
        states, _, _ = chunk_states(k_flat, v_flat, gamma, beta_flat, inverse, h0, cu_seqlens,
                                    value_block=value_block, offsets=offsets, num_chunks=chunk_index.shape[0])

    if dht is None:
        dht = torch.zeros(num_sequences, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    dht = dht.to(torch.float32).contiguous()
    if state_grads_in_pieces and plan.walk_ahead_index is not None:
        # The forward cut these sequences into pieces; walk the state gradients in the same pieces,
        # each from a decay-truncated warm-up after its end.
        ends = walk_ends(gamma, plan.walk_ahead_index, DEFAULT_LOG_DECAY_THRESHOLD)
        state_grads, dh0 = state_gradients(q_flat, k_flat, gamma, gated_inverse, scores, do_flat, dht, scale,
                                           cu_seqlens, offsets, chunk_index.shape[0], plan.value_block,
                                           pieces=plan.pieces, walk_end=ends)
    else:
        state_grads, dh0 = state_gradients(q_flat, k_flat, gamma, gated_inverse, scores, do_flat, dht, scale,
                                           cu_seqlens, offsets, chunk_index.shape[0], value_block)
    dq_head, dk_head, dv, dg, dbeta = chunk_gradients(q_flat, k_flat, v_flat, gamma, beta_flat, inverse, states,
                                                      state_grads, do_flat, scale, cu_seqlens, chunk_index)

    # Deterministic reduction over the value heads sharing a q/k head, accumulated in float32 and
    # rounded once: straight to bf16 for bf16 inputs (one pass), through float32 for float16.
    dq, dk = dq_head, dk_head
    if group > 1:
        sum_dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        dq = dq_head.view(num_tokens, num_qk_heads, group, HEAD_DIM).sum(2, dtype=sum_dtype)
        dk = dk_head.view(num_tokens, num_qk_heads, group, HEAD_DIM).sum(2, dtype=sum_dtype)
    return (
        dq.view(q.shape).to(q.dtype),
        dk.view(k.shape).to(k.dtype),
        dv.view(v.shape).to(v.dtype),
        dg.view(g.shape),
        dbeta.view(beta.shape),
        dh0,
    )
