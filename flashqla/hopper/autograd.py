"""The "tilelang" backend's runner: the Hopper forward and backward entries joined for autograd.

With use_qk_l2norm_in_kernel the q/k L2 norm is part of the Function: the inverse's kernel makes its r
(inverse.py, normalize_qk), every kernel applies r to q and k on chip, and backward.py carries the
gradients through it; besides q and k the Function keeps only r (4 bytes a row), and q^, k^ are
never written.

The kernel modules are imported inside forward and backward: this module, and the backend
registry that names it, import without tilelang.
"""
import torch


def chunk_gated_delta_rule_hopper(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_host, keep_for_backward):
    """(o, final_state or None) for inputs the public op has checked (scale resolved, cu_seqlens_host
    the offsets as a list or None). keep_for_backward (True, "inverse" or False, as the public op
    takes it): what the forward keeps of its intermediates for the backward, which they are only
    when autograd will run one (see keeps_for_backward)."""
    # Saved for the backward as contiguous tensors: a view (v split from the layer's fused conv
    # output, say) would keep its whole base alive until the backward.
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    keep = bool(keep_for_backward) and keeps_for_backward(q, k, v, g, beta, initial_state)
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             cu_seqlens, cu_seqlens_host, use_qk_l2norm_in_kernel, keep,
                                             keep_for_backward is True)


def keeps_for_backward(*inputs) -> bool:
    """Whether autograd will run a backward through these inputs, so that tensors kept for it are
    read: asked before Function.apply (inside Function.forward grad mode is always off, and
    needs_input_grad ignores no_grad)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Saves the inputs (and under `l2norm` the norm's r of q and k) and, when `keep`, the forward's
    gamma, A~ and (with `keep_chunk_states`) chunk states (forward.KeptForward), which the backward
    then does not recompute."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_host,
                l2norm=False, keep=False, keep_chunk_states=True):
        from flashqla.hopper import forward

        o, final_state, *extras = forward.forward(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_host=cu_seqlens_host,
            keep_for_backward=keep, keep_chunk_states=keep_chunk_states, normalize_qk=l2norm,
        )
        rstds = extras.pop() if l2norm else ()
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *rstds, *(extras[0] if keep else ()))
        ctx.l2norm = l2norm
        ctx.scale = scale
        ctx.cu_seqlens_host = cu_seqlens_host
        return o, final_state

    @staticmethod
    def backward(ctx, d_o, d_final_state):
        from flashqla.hopper import backward, forward

        q, k, v, g, beta, initial_state, cu_seqlens, *rest = ctx.saved_tensors
        rstds, kept = (rest[:2], rest[2:]) if ctx.l2norm else ((None, None), rest)
        dq, dk, dv, dg, dbeta, dh0 = backward.backward(
            q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, d_o, d_final_state,
            cu_seqlens_host=ctx.cu_seqlens_host, kept=forward.KeptForward(*kept) if kept else None,
            q_rstd=rstds[0], k_rstd=rstds[1],
        )
        dh0 = dh0 if initial_state is not None else None
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None, None, None
