"""Fused chunk-parallel backward of the chunked gated delta rule (gdn-kernels.md section 3).

One CTA per (chunk, value head). With the state entering the chunk (S0, from the state-only
kernel) and the state gradient leaving it (dS1, from backward_state_grads.py) every chunk is
independent, so the heavy part of the backward fills the GPU even with few heads. Each CTA reads
q, k, v, dO, gamma, beta, A~, S0, dS1 and writes dv, dg, dbeta and this value head's dq, dk
(summed over each head group in `backward.py`).
"""

import functools

import tilelang
import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import CHUNK_SIZE
from flashqla.hopper.cumsum import HOPPER_TARGET

_C = CHUNK_SIZE
_THREADS = 256
HEAD_DIM = 128


def fused_backward_program():
    """Kernel for K = V = 128, bf16 operands (q, k, v, dO, A~, states, state gradients), float32
    gamma and beta; head counts, lengths and scale are run-time values."""
    K = V = HEAD_DIM
    BV = V
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    op = "bfloat16"
    f32 = "float32"

    @T.prim_func
    def fused_backward_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), op),
        k: T.Tensor((num_tokens, num_qk_heads, K), op),
        v: T.Tensor((num_tokens, num_v_heads, V), op),
        gamma: T.Tensor((num_tokens, num_v_heads), f32),
        beta: T.Tensor((num_tokens, num_v_heads), f32),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), op),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), op),
        chunk_state_grads: T.Tensor((num_chunks, num_v_heads, K, V), op),
        do: T.Tensor((num_tokens, num_v_heads, V), op),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_index: T.Tensor((num_chunks, 2), "int32"),
        dq_head: T.Tensor((num_tokens, num_v_heads, K), op),
        dk_head: T.Tensor((num_tokens, num_v_heads, K), op),
        dv: T.Tensor((num_tokens, num_v_heads, V), op),
        dg: T.Tensor((num_tokens, num_v_heads), f32),
        dbeta: T.Tensor((num_tokens, num_v_heads), f32),
        scale: T.float32,
    ):
        with T.Kernel(num_chunks, num_v_heads, threads=_THREADS) as (chunk_id, head):
            qk_head = head // (num_v_heads // num_qk_heads)
            seq = chunk_index[chunk_id, 0]
            start = cu_seqlens[seq] + chunk_index[chunk_id, 1] * _C
            length = T.min(cu_seqlens[seq + 1] - start, _C)

            q_s = T.alloc_shared((_C, K), op)
            k_s = T.alloc_shared((_C, K), op)
            v_s = T.alloc_shared((_C, BV), op)
            do_s = T.alloc_shared((_C, BV), op)
            inv_s = T.alloc_shared((_C, _C), op)
            s0_s = T.alloc_shared((K, BV), op)
            ds_s = T.alloc_shared((K, BV), op)
            pm_s = T.alloc_shared((_C, _C), op)  # scale * (Gm . QK^T), the masked output weights
            ab_s = T.alloc_shared((_C, _C), op)  # (Gm . A~) diag(beta)
            w_s = T.alloc_shared((_C, BV), op)
            delta_s = T.alloc_shared((_C, BV), op)
            d_delta_s = T.alloc_shared((_C, BV), op)
            du_s = T.alloc_shared((_C, BV), op)
            d_inv_s = T.alloc_shared((_C, _C), op)
            dpm_s = T.alloc_shared((_C, _C), op)
            t1_s = T.alloc_shared((_C, _C), op)
            dl_sym_s = T.alloc_shared((_C, _C), op)
            cc_s = T.alloc_shared((_C, _C), f32)  # scratch for transposes
            b_s = T.alloc_shared((_C,), f32)
            gam_s = T.alloc_shared((_C,), f32)
            dec_s = T.alloc_shared((_C,), f32)  # e^{gamma_t}
            rdec_s = T.alloc_shared((_C,), f32)  # e^{gamma_C - gamma_t}
            dgam_s = T.alloc_shared((_C,), f32)
            te_s = T.alloc_shared((_C,), f32)
            gamma_c_s = T.alloc_shared((_C,), f32)
            dbeta_s = T.alloc_shared((_C,), f32)
            state_dot_s = T.alloc_shared((K,), f32)

            qk = T.alloc_fragment((_C, _C), f32)
            gm = T.alloc_fragment((_C, _C), f32)
            ag = T.alloc_fragment((_C, _C), f32)
            u = T.alloc_fragment((_C, BV), f32)
            delta = T.alloc_fragment((_C, BV), f32)
            d_delta = T.alloc_fragment((_C, BV), f32)
            dw = T.alloc_fragment((_C, BV), f32)
            cv = T.alloc_fragment((_C, BV), f32)
            dab = T.alloc_fragment((_C, _C), f32)
            dpr = T.alloc_fragment((_C, _C), f32)
            cc = T.alloc_fragment((_C, _C), f32)
            cc2 = T.alloc_fragment((_C, _C), f32)
            t1 = T.alloc_fragment((_C, _C), f32)
            dl = T.alloc_fragment((_C, _C), f32)
            kk = T.alloc_fragment((_C, _C), f32)
            dq = T.alloc_fragment((_C, K), f32)
            dk = T.alloc_fragment((_C, K), f32)
            ck = T.alloc_fragment((_C, K), f32)
            kv = T.alloc_fragment((K, BV), f32)
            row = T.alloc_fragment((_C,), f32)  # row sums of C x C fragments
            col_sum = T.alloc_fragment((_C,), f32)
            row_v = T.alloc_fragment((_C,), f32)  # row sums of C x BV fragments
            row_d = T.alloc_fragment((_C,), f32)  # row sums of C x K fragments
            row_k = T.alloc_fragment((K,), f32)
            dg_mat = T.alloc_fragment((_C, _C), f32)
            dg_row = T.alloc_fragment((_C,), f32)
            sd_mat = T.alloc_fragment((_C, K), f32)
            sd_row = T.alloc_fragment((_C,), f32)

            # Whole tiles: rows past the sequence end hold the next sequence's data. Masking the
            # rows of Gm and beta and the padded rows' dgamma keeps them out of every gradient
            # (each product that mixes rows goes through Gm, Ab or beta).
            T.copy(q[start:start + _C, qk_head, 0:K], q_s)
            T.copy(k[start:start + _C, qk_head, 0:K], k_s)
            T.copy(v[start:start + _C, head, 0:V], v_s)
            T.copy(do[start:start + _C, head, 0:V], do_s)
            T.copy(inverse[start:start + _C, head, 0:_C], inv_s)
            for t in T.Parallel(_C):
                gam_s[t] = gamma[start + T.min(t, length - 1), head]
                b_s[t] = T.if_then_else(t < length, beta[start + t, head], 0.0)
            T.copy(chunk_states[chunk_id, head, 0:K, 0:V], s0_s)
            T.copy(chunk_state_grads[chunk_id, head, 0:K, 0:V], ds_s)
            for t in T.Parallel(_C):
                dec_s[t] = T.exp(gam_s[t])
                rdec_s[t] = T.exp(gam_s[_C - 1] - gam_s[t])
            for t, s in T.Parallel(_C, _C):
                gm[t, s] = T.if_then_else((s <= t) & (t < length), T.exp(gam_s[t] - gam_s[s]), 0.0)

            T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                pm_s[t, s] = T.cast(scale * qk[t, s] * gm[t, s], op)
            for t, s in T.Parallel(_C, _C):
                ag[t, s] = T.cast(inv_s[t, s], f32) * gm[t, s]
            for t, s in T.Parallel(_C, _C):
                ab_s[t, s] = T.cast(ag[t, s] * b_s[s], op)

            # U = K S0, W = V - D U, Delta = Ab W
            T.gemm(k_s, s0_s, u, clear_accum=True)
            for t, d in T.Parallel(_C, BV):
                w_s[t, d] = T.cast(T.cast(v_s[t, d], f32) - dec_s[t] * u[t, d], op)
            T.gemm(ab_s, w_s, delta, clear_accum=True)
            for t, d in T.Parallel(_C, BV):
                delta_s[t, d] = T.cast(delta[t, d], op)

            # dDelta = E K dS1 + Pm^T dO;  the E term also feeds dgamma (te).
            T.gemm(k_s, ds_s, d_delta, clear_accum=True)
            for t, d in T.Parallel(_C, BV):
                d_delta[t, d] = d_delta[t, d] * rdec_s[t]
            for t, d in T.Parallel(_C, BV):
                cv[t, d] = delta[t, d] * d_delta[t, d]
            T.reduce_sum(cv, row_v, dim=1, clear=True)
            for t in T.Parallel(_C):
                te_s[t] = row_v[t]
            T.gemm(pm_s, do_s, d_delta, transpose_A=True)
            for t, d in T.Parallel(_C, BV):
                d_delta_s[t, d] = T.cast(d_delta[t, d], op)

            # dW = Ab^T dDelta = dV;  dU = -D dW
            T.gemm(ab_s, d_delta_s, dw, transpose_A=True, clear_accum=True)
            for t, d in T.Parallel(_C, BV):
                if t < length:
                    dv[start + t, head, d] = T.cast(dw[t, d], op)
            for t, d in T.Parallel(_C, BV):
                dw[t, d] = -dec_s[t] * dw[t, d]
            for t, d in T.Parallel(_C, BV):
                cv[t, d] = dw[t, d] * u[t, d]
            T.reduce_sum(cv, row_v, dim=1, clear=True)
            for t in T.Parallel(_C):
                dgam_s[t] = row_v[t] - te_s[t]
            for t, d in T.Parallel(_C, BV):
                du_s[t, d] = T.cast(dw[t, d], op)

            # dAb = dDelta W^T: dbeta (column sums with Ag), dAg = dAb diag(beta)
            T.gemm(d_delta_s, w_s, dab, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                cc_s[t, s] = dab[t, s] * ag[t, s]
            for t, s in T.Parallel(_C, _C):
                cc2[t, s] = cc_s[s, t]
            T.reduce_sum(cc2, col_sum, dim=1, clear=True)
            for t in T.Parallel(_C):
                dbeta_s[t] = col_sum[t]
            for t, s in T.Parallel(_C, _C):
                dab[t, s] = dab[t, s] * b_s[s]
            for t, s in T.Parallel(_C, _C):
                d_inv_s[t, s] = T.cast(dab[t, s] * gm[t, s], op)

            # dP = scale dO Delta^T; dGm terms give dgamma (row sums minus column sums)
            T.gemm(do_s, delta_s, dpr, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                cc[t, s] = dab[t, s] * ag[t, s] + scale * dpr[t, s] * qk[t, s] * gm[t, s]
            T.reduce_sum(cc, row, dim=1, clear=True)
            for t, s in T.Parallel(_C, _C):
                cc_s[t, s] = cc[t, s]
            for t, s in T.Parallel(_C, _C):
                cc2[t, s] = cc_s[s, t]
            for t in T.Parallel(_C):
                dgam_s[t] = dgam_s[t] + row[t]
            T.reduce_sum(cc2, col_sum, dim=1, clear=True)
            for t in T.Parallel(_C):
                dgam_s[t] = dgam_s[t] - col_sum[t]
            for t, s in T.Parallel(_C, _C):
                dpm_s[t, s] = T.cast(scale * dpr[t, s] * gm[t, s], op)

            # dQ = scale D dO S0^T + dPm K
            T.gemm(do_s, s0_s, dq, transpose_B=True, clear_accum=True)
            for t, d in T.Parallel(_C, K):
                dq[t, d] = dq[t, d] * (scale * dec_s[t])
            for t, d in T.Parallel(_C, K):
                ck[t, d] = dq[t, d] * T.cast(q_s[t, d], f32)
            T.reduce_sum(ck, row_d, dim=1, clear=True)
            for t in T.Parallel(_C):
                dgam_s[t] = dgam_s[t] + row_d[t]
            T.gemm(dpm_s, k_s, dq)
            for t, d in T.Parallel(_C, K):
                if t < length:
                    dq_head[start + t, head, d] = T.cast(dq[t, d], op)

            # dK = E Delta dS1^T + dU S0^T + dPm^T Q + (dL diag-beta terms)
            T.gemm(delta_s, ds_s, dk, transpose_B=True, clear_accum=True)
            for t, d in T.Parallel(_C, K):
                dk[t, d] = dk[t, d] * rdec_s[t]
            T.gemm(du_s, s0_s, dk, transpose_B=True)
            T.gemm(dpm_s, q_s, dk, transpose_A=True)

            # dL = -A~^T dA~ A~^T (strictly lower); L_ts = beta_t k_t.k_s
            T.gemm(inv_s, d_inv_s, t1, transpose_A=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                t1_s[t, s] = T.cast(t1[t, s], op)
            T.gemm(t1_s, inv_s, dl, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                dl[t, s] = T.if_then_else(s < t, -dl[t, s], 0.0)
            T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                cc[t, s] = dl[t, s] * kk[t, s]
            T.reduce_sum(cc, row, dim=1, clear=True)
            for t in T.Parallel(_C):
                dbeta_s[t] = dbeta_s[t] + row[t]
            for t, s in T.Parallel(_C, _C):
                cc_s[t, s] = dl[t, s] * b_s[t]
            for t, s in T.Parallel(_C, _C):
                dl_sym_s[t, s] = T.cast(cc_s[t, s] + cc_s[s, t], op)
            T.gemm(dl_sym_s, k_s, dk)
            for t, d in T.Parallel(_C, K):
                if t < length:
                    dk_head[start + t, head, d] = T.cast(dk[t, d], op)

            # dgamma_C += e^{gamma_C} sum(S0 . dS1)
            for i, j in T.Parallel(K, V):
                kv[i, j] = T.cast(ds_s[i, j], f32) * T.cast(s0_s[i, j], f32)
            T.reduce_sum(kv, row_k, dim=1, clear=True)
            for i in T.Parallel(K):
                state_dot_s[i] = row_k[i]

            # dg = reverse cumsum of dgamma within the chunk; every row also gets the gamma_C terms
            # (sum of te and e^{gamma_C} sum(S0 . dS1)). Reductions, not serial loops, for latency.
            for t, j in T.Parallel(_C, _C):
                dg_mat[t, j] = T.if_then_else((j >= t) & (j < length), dgam_s[j], 0.0) + te_s[j]
            T.reduce_sum(dg_mat, dg_row, dim=1, clear=True)
            for t, i in T.Parallel(_C, K):
                sd_mat[t, i] = state_dot_s[i]
            T.reduce_sum(sd_mat, sd_row, dim=1, clear=True)
            for t in T.Parallel(_C):
                gamma_c_s[t] = sd_row[t] * dec_s[_C - 1]
            for t in T.Parallel(_C):
                if t < length:
                    dg[start + t, head] = dg_row[t] + gamma_c_s[t]
                    dbeta[start + t, head] = dbeta_s[t]

    return fused_backward_kernel


@functools.lru_cache(maxsize=None)
def compile_fused_backward():
    return tilelang.compile(fused_backward_program(), target=HOPPER_TARGET,
                            pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})


def fused_backward(q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, scale, cu_seqlens,
                   chunk_index):
    """Run the kernel on flattened inputs; returns (dq, dk per value head, dv, dg, dbeta).

    q, k: [T, Hqk, 128] bf16; v, do: [T, Hv, 128] bf16; gamma (chunk-local cumsum), beta: [T, Hv] fp32;
    inverse: [T, Hv, 64] bf16; chunk_states (entering each chunk), chunk_state_grads (leaving it):
    [num_chunks, Hv, 128, 128] bf16 in chunk_index order; cu_seqlens: int32 [N + 1];
    chunk_index: int32 [num_chunks, 2] (sequence, chunk within it).
    dq, dk, dv: bf16 [T, Hv, 128]; dg, dbeta: float32 [T, Hv].
    """
    num_tokens, _, head_dim = q.shape
    num_v_heads = v.shape[1]
    f32 = dict(dtype=torch.float32, device=q.device)
    bf16 = dict(dtype=torch.bfloat16, device=q.device)
    dq_head = torch.empty(num_tokens, num_v_heads, head_dim, **bf16)
    dk_head = torch.empty(num_tokens, num_v_heads, head_dim, **bf16)
    dv = torch.empty(num_tokens, num_v_heads, head_dim, **bf16)
    dg = torch.empty(num_tokens, num_v_heads, **f32)
    dbeta = torch.empty(num_tokens, num_v_heads, **f32)
    if chunk_index.shape[0] > 0:
        compile_fused_backward()(q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, cu_seqlens,
                                 chunk_index, dq_head, dk_head, dv, dg, dbeta, float(scale))
    return dq_head, dk_head, dv, dg, dbeta
