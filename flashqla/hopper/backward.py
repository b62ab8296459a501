"""The backward's entry: the gradients of (o, final state), from the kernels in the order they run.

1. Without the forward's `KeptForward`, run the forward again for it (forward.py: gamma, A~ and the
   state entering every chunk, its walk in pieces); with one that has no chunk states, only the walk
   (forward.walk_chunks, on the forward's own plan: the states come out bitwise).
2. One reverse walk over the chunks (backward_fused.py): the state gradient (docs/gdn-math.md §3.1)
   stays on chip while dq, dk, dv, dg, dbeta of each chunk (§3.2-3.3) and dh0 are made. Sequences
   the forward's plan cut are walked in the same pieces, each from a decay-truncated warm-up after
   its end (walk_bounds.py, docs/gdn-math.md §4).
3. The backward of the q/k L2 norm when the forward applied it (l2norm.py).
dq and dk come per value head and are summed over each head group in one deterministic pass (no
atomics): in the L2 norm's backward kernel when the forward applied the norm, else in torch.
"""

import torch

from flashqla.hopper.backward_fused import fused_backward_grads
from flashqla.hopper.chunk_plan import device_sm_count, flat_cu_seqlens, plan_forward
from flashqla.hopper.common import DEFAULT_LOG_DECAY_THRESHOLD, HEAD_DIM, unsupported_inputs
from flashqla.hopper.forward import KeptForward, forward, walk_chunks
from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK
from flashqla.hopper.l2norm import l2norm_backward
from flashqla.hopper.walk_bounds import walk_bounds


def backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, cu_seqlens_host: list[int] | None = None,
             kept: KeptForward | None = None, log_decay_threshold: float = DEFAULT_LOG_DECAY_THRESHOLD,
             q_rstd: torch.Tensor | None = None, k_rstd: torch.Tensor | None = None,
             timeline: torch.Tensor | None = None, norm_in_fused_walk: bool = False,
             walk_registers: tuple[int, int, int, int] | None = None, ragged_cuts: bool = False):
    """Gradients of (o, final_state) for inputs as given to `forward.forward`.

    q, k: [B, T, Hqk, 128]; v, do: [B, T, Hv, 128]; g, beta: [B, T, Hv]; initial_state, dht:
    [N, Hv, 128, 128] or None; cu_seqlens: int [N + 1] (B = 1) or None.
    Returns (dq, dk, dv, dg, dbeta, dh0): dq, dk, dv in q's dtype and shape (dq, dk summed over each
    value-head group); dg, dbeta float32 [B, T, Hv]; dh0 float32 [N, Hv, 128, 128], also when
    there is no initial state (the gradient a zero initial state would get).
    cu_seqlens_host: cu_seqlens as a list when the caller holds it (the forward's plan is then
    reused from its cache with no device->host read).
    kept: what `forward.forward(..., keep_for_backward=True)` returned for these inputs; when None the
    forward runs again to make it.
    log_decay_threshold: how far the reverse walk of a piece may truncate what comes after it
    (walk_bounds.py); -inf walks every piece from its sequence end, which gives bitwise the gradients
    of one walk over the whole sequence.
    q_rstd, k_rstd (both or neither): q and k are the inputs of use_qk_l2norm_in_kernel's norm and these
    its r, float32 [B * T * Hqk] (what forward.forward(..., normalize_qk=True) returns); the gradients are
    those of the op on q^, k^, carried through the norm to q and k. q and k must then be contiguous (the
    Function saves them so).
    timeline: the fused walk's clock stamps (backward_fused.timeline_shape for the forward plan's pieces;
    tools/walk_timeline.py). norm_in_fused_walk (candidate: 1.07-1.10x the walk followed by the norm's kernel,
    docs/performance.md, forty-third session; its tests through the op have not run): the L2 norm's backward
    inside the fused walk where every value head has its own q, k head (else its own kernel after the group
    sum). walk_registers (candidate, e.g. backward_fused.DELTA_HEAVY_REGISTERS; None: the walk's): the walk's
    registers a thread per role; bitwise the same gradients. ragged_cuts (candidate): what the forward was given.
    """
    reason = unsupported_inputs(q, v)
    if reason is not None:
        raise ValueError(f"flashqla.hopper.backward {reason}")
    batch_size, seq_len, num_qk_heads, _ = q.shape
    num_v_heads = v.shape[2]
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
    # the forward's plan, from its cache: its pieces are the reverse walk's (one CTA per piece and value head)
    plan = plan_forward(cu_seqlens, num_v_heads, HEAD_DIM, sm_count, MAX_VALUE_BLOCK, host_bounds=cu_seqlens_host,
                        ragged_cuts=ragged_cuts)

    # The kernels read bf16 operands; float16 inputs are converted once here.
    def flat(x, heads):
        return x.reshape(num_tokens, heads, HEAD_DIM).to(torch.bfloat16).contiguous()

    v_flat, do_flat = flat(v, num_v_heads), flat(do, num_v_heads)
    beta_flat = beta.reshape(num_tokens, num_v_heads).to(torch.float32).contiguous()

    rstds = None if q_rstd is None else (q_rstd.view(num_tokens, num_qk_heads), k_rstd.view(num_tokens, num_qk_heads))
    # kernel_rstds: the norm the kernels apply on chip. float16 rows are normalised here instead, in float32,
    # and rounded to bf16 once (rounded to bf16 and then normalised on chip they would be rounded twice).
    kernel_rstds = rstds
    if rstds is not None and q.dtype == torch.float16:
        q_flat, k_flat = (flat(x.reshape(num_tokens, num_qk_heads, HEAD_DIM).float() * rstd[..., None], num_qk_heads)
                          for x, rstd in ((q, rstds[0]), (k, rstds[1])))
        kernel_rstds = None
    else:
        q_flat, k_flat = flat(q, num_qk_heads), flat(k, num_qk_heads)
    if kept is None:
        # run the forward again, keeping what this backward reads: every piece in parallel
        _, _, kept, *_ = forward(q, k, v, g, beta, scale, initial_state, False, cu_seqlens,
                                 cu_seqlens_host=cu_seqlens_host, keep_for_backward=True,
                                 normalize_qk=rstds is not None, ragged_cuts=ragged_cuts)
    # float16 inputs were kept float16: the kernels here read bf16
    gamma = kept.gamma
    inverse = kept.inverse.to(torch.bfloat16)
    if kept.chunk_states is not None:
        states = kept.chunk_states.to(torch.bfloat16)
    else:  # the forward kept gamma and A~ but not the states: walk the chunks again, on its plan
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        _, _, states = walk_chunks(q_flat, k_flat, v_flat, gamma, beta_flat, inverse, scale, h0, cu_seqlens, plan,
                                   store_chunk_states=True, rstds=kernel_rstds)

    if dht is None:
        dht = torch.zeros(num_sequences, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    dht = dht.to(torch.float32).contiguous()
    walk_end = walk_bounds(gamma, plan.pieces, cu_seqlens, ahead=True, log_decay_threshold=log_decay_threshold)
    norm_in_walk = norm_in_fused_walk and kernel_rstds is not None and num_v_heads == num_qk_heads
    dq_head, dk_head, dv, dg, dbeta, dh0 = fused_backward_grads(
        q_flat, k_flat, v_flat, gamma, beta_flat, inverse, states, do_flat, dht, scale, cu_seqlens,
        plan.chunk_offsets, plan.pieces, walk_end, rstds=kernel_rstds, timeline=timeline, l2norm_backward=norm_in_walk,
        registers=walk_registers)
    return _finish(q, k, v, g, beta, dq_head, dk_head, dv, dg, dbeta, dh0, rstds, norm_in_walk, num_qk_heads)


def _finish(q, k, v, g, beta, dq_head, dk_head, dv, dg, dbeta, dh0, rstds, norm_in_kernel: bool, num_qk_heads: int):
    """backward's result from the kernels' per-value-head gradients: the norm's backward (unless the kernel
    applied it) and the sum over head groups, then the inputs' shapes and dtypes."""
    if rstds is not None and not norm_in_kernel:
        dq, dk = (l2norm_backward(grad.view(-1, HEAD_DIM), x.reshape(-1, HEAD_DIM), rstd.reshape(-1))
                  for grad, x, rstd in ((dq_head, q, rstds[0]), (dk_head, k, rstds[1])))
    else:
        dq, dk = (sum_over_groups(grad, num_qk_heads, q.dtype) for grad in (dq_head, dk_head))
    return (
        dq.view(q.shape).to(q.dtype),
        dk.view(k.shape).to(k.dtype),
        dv.view(v.shape).to(v.dtype),
        dg.view(g.shape),
        dbeta.view(beta.shape),
        dh0,
    )


def sum_over_groups(head_grads: torch.Tensor, num_qk_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, Hqk, 128] from per-value-head gradients [T, Hv, 128] (head_grads itself when Hv = Hqk): a
    deterministic reduction over the value heads sharing a q/k head, accumulated in float32 and
    rounded once, straight to bf16 for bf16 inputs (dtype; one pass), through float32 for float16."""
    num_tokens, num_v_heads, width = head_grads.shape
    if num_v_heads == num_qk_heads:
        return head_grads
    sum_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return head_grads.view(num_tokens, num_qk_heads, num_v_heads // num_qk_heads, width).sum(2, dtype=sum_dtype)
