"""Fused backward of the chunked gated delta rule (gdn-kernels.md section 3).

One CTA per (V block, value head, sequence) walks the sequence's chunks in reverse, carrying the
state gradient dS (K x V block, float32) in registers. Each chunk reads q, k, v, dO, g, beta, the
gate-free inverse A~ and the state S0 entering the chunk (recomputed by the state-only kernel),
and produces dv (complete) and this V block's share of dq, dk, dg, dbeta. Every dq/dk/dg/dbeta
term is a sum over V, so the shares of the V blocks add up (in `backward.py`, deterministically).
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


def fused_backward_program(value_block: int = 64):
    """Kernel for K = V = 128, bf16 operands (q, k, v, dO, A~, chunk states), float32 g and beta;
    head counts, lengths and scale are run-time values."""
    K = V = HEAD_DIM
    BV = value_block
    num_value_blocks = V // BV
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
        g: T.Tensor((num_tokens, num_v_heads), f32),
        beta: T.Tensor((num_tokens, num_v_heads), f32),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), op),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), op),
        do: T.Tensor((num_tokens, num_v_heads, V), op),
        dht: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        dq_part: T.Tensor((num_value_blocks, num_tokens, num_v_heads, K), f32),
        dk_part: T.Tensor((num_value_blocks, num_tokens, num_v_heads, K), f32),
        dv: T.Tensor((num_tokens, num_v_heads, V), op),
        dg_part: T.Tensor((num_value_blocks, num_tokens, num_v_heads), f32),
        dbeta_part: T.Tensor((num_value_blocks, num_tokens, num_v_heads), f32),
        dh0: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        scale: T.float32,
    ):
        with T.Kernel(num_value_blocks, num_v_heads, num_sequences, threads=_THREADS) as (vblock, head, seq):
            qk_head = head // (num_v_heads // num_qk_heads)
            v0 = vblock * BV
            bos = cu_seqlens[seq]
            eos = cu_seqlens[seq + 1]
            seq_chunks = (eos - bos + _C - 1) // _C
            first_chunk = chunk_offsets[seq]

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
            dog_s = T.alloc_shared((_C, BV), op)
            d_inv_s = T.alloc_shared((_C, _C), op)
            dpm_s = T.alloc_shared((_C, _C), op)
            t1_s = T.alloc_shared((_C, _C), op)
            dl_sym_s = T.alloc_shared((_C, _C), op)
            cc_s = T.alloc_shared((_C, _C), f32)  # scratch for transposes
            g_s = T.alloc_shared((_C,), f32)
            b_s = T.alloc_shared((_C,), f32)
            gam_s = T.alloc_shared((_C,), f32)
            dec_s = T.alloc_shared((_C,), f32)  # e^{gamma_t}
            rdec_s = T.alloc_shared((_C,), f32)  # e^{gamma_C - gamma_t}
            dgam_s = T.alloc_shared((_C,), f32)
            te_s = T.alloc_shared((_C,), f32)
            gamma_c_s = T.alloc_shared((_C,), f32)
            dbeta_s = T.alloc_shared((_C,), f32)
            state_dot_s = T.alloc_shared((K,), f32)

            ds = T.alloc_fragment((K, BV), f32)
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
            g_lower = T.alloc_fragment((_C, _C), f32)
            gam_row = T.alloc_fragment((_C,), f32)
            row = T.alloc_fragment((_C,), f32)  # row sums of C x C fragments
            col_sum = T.alloc_fragment((_C,), f32)
            row_v = T.alloc_fragment((_C,), f32)  # row sums of C x BV fragments
            row_d = T.alloc_fragment((_C,), f32)  # row sums of C x K fragments
            row_k = T.alloc_fragment((K,), f32)
            dg_mat = T.alloc_fragment((_C, _C), f32)
            dg_row = T.alloc_fragment((_C,), f32)
            sd_mat = T.alloc_fragment((_C, K), f32)
            sd_row = T.alloc_fragment((_C,), f32)

            T.copy(dht[seq, head, 0:K, v0:v0 + BV], ds)
            for it in T.serial(seq_chunks):
                chunk = seq_chunks - 1 - it
                start = bos + chunk * _C
                length = T.min(eos - start, _C)

                # Loads; rows past the sequence end read as zeros (they may belong to the next one).
                for t, d in T.Parallel(_C, K):
                    q_s[t, d] = T.if_then_else(t < length, q[start + t, qk_head, d], T.cast(0, op))
                    k_s[t, d] = T.if_then_else(t < length, k[start + t, qk_head, d], T.cast(0, op))
                for t, d in T.Parallel(_C, BV):
                    v_s[t, d] = T.if_then_else(t < length, v[start + t, head, v0 + d], T.cast(0, op))
                    do_s[t, d] = T.if_then_else(t < length, do[start + t, head, v0 + d], T.cast(0, op))
                for t, s in T.Parallel(_C, _C):
                    inv_s[t, s] = T.if_then_else(t < length, inverse[start + t, head, s], T.cast(0, op))
                for t in T.Parallel(_C):
                    g_s[t] = T.if_then_else(t < length, g[start + t, head], 0.0)
                    b_s[t] = T.if_then_else(t < length, beta[start + t, head], 0.0)
                T.copy(chunk_states[first_chunk + chunk, head, 0:K, v0:v0 + BV], s0_s)
                for i, j in T.Parallel(K, BV):
                    ds_s[i, j] = T.cast(ds[i, j], op)

                # gamma = cumsum(g); padded rows keep the last real gamma (g reads 0 there).
                for t, s in T.Parallel(_C, _C):
                    g_lower[t, s] = T.if_then_else(s <= t, g_s[s], 0.0)
                T.reduce_sum(g_lower, gam_row, dim=1, clear=True)
                for t in T.Parallel(_C):
                    gam_s[t] = gam_row[t]
                for t in T.Parallel(_C):
                    dec_s[t] = T.exp(gam_s[t])
                    rdec_s[t] = T.exp(gam_s[_C - 1] - gam_s[t])
                for t, s in T.Parallel(_C, _C):
                    gm[t, s] = T.if_then_else(s <= t, T.exp(gam_s[t] - gam_s[s]), 0.0)

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
                        dv[start + t, head, v0 + d] = T.cast(dw[t, d], op)
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
                        dq_part[vblock, start + t, head, d] = dq[t, d]

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
                        dk_part[vblock, start + t, head, d] = dk[t, d]

                # dgamma_C += e^{gamma_C} sum(S0 . dS1); then dS0 = e^{gamma_C} dS1 + Q^T (scale D dO) + K^T dU
                for i, j in T.Parallel(K, BV):
                    kv[i, j] = ds[i, j] * T.cast(s0_s[i, j], f32)
                T.reduce_sum(kv, row_k, dim=1, clear=True)
                for i in T.Parallel(K):
                    state_dot_s[i] = row_k[i]
                for i, j in T.Parallel(K, BV):
                    ds[i, j] = ds[i, j] * dec_s[_C - 1]
                for t, d in T.Parallel(_C, BV):
                    dog_s[t, d] = T.cast(scale * dec_s[t] * T.cast(do_s[t, d], f32), op)
                T.gemm(q_s, dog_s, ds, transpose_A=True)
                T.gemm(k_s, du_s, ds, transpose_A=True)

                # dg = reverse cumsum of dgamma within the chunk; every row also gets the gamma_C terms
                # (sum of te and e^{gamma_C} sum(S0 . dS1)). Reductions, not serial loops, for latency.
                for t, j in T.Parallel(_C, _C):
                    dg_mat[t, j] = T.if_then_else(j >= t, dgam_s[j], 0.0) + te_s[j]
                T.reduce_sum(dg_mat, dg_row, dim=1, clear=True)
                for t, i in T.Parallel(_C, K):
                    sd_mat[t, i] = state_dot_s[i]
                T.reduce_sum(sd_mat, sd_row, dim=1, clear=True)
                for t in T.Parallel(_C):
                    gamma_c_s[t] = sd_row[t] * dec_s[_C - 1]
                for t in T.Parallel(_C):
                    if t < length:
                        dg_part[vblock, start + t, head] = dg_row[t] + gamma_c_s[t]
                        dbeta_part[vblock, start + t, head] = dbeta_s[t]

            T.copy(ds, dh0[seq, head, 0:K, v0:v0 + BV])

    return fused_backward_kernel


@functools.lru_cache(maxsize=None)
def compile_fused_backward(value_block: int = 64):
    return tilelang.compile(fused_backward_program(value_block), target=HOPPER_TARGET)


def fused_backward(q, k, v, g, beta, inverse, chunk_states, do, dht, scale, cu_seqlens, offsets, value_block):
    """Run the kernel on flattened inputs; returns per-V-block shares (dq, dk, dg, dbeta), dv, dh0.

    q, k: [T, Hqk, 128] bf16; v, do: [T, Hv, 128] bf16; g, beta: [T, Hv] fp32; inverse: [T, Hv, 64] bf16;
    chunk_states: [num_chunks, Hv, 128, 128] bf16 (row offsets[n] + c is chunk c of sequence n);
    dht: [N, Hv, 128, 128] fp32; cu_seqlens, offsets: int32 [N + 1].
    Shares are float32 [V / value_block, T, Hv, 128] and [V / value_block, T, Hv].
    """
    num_tokens, num_qk_heads, head_dim = q.shape
    num_v_heads = v.shape[1]
    num_sequences = cu_seqlens.numel() - 1
    blocks = HEAD_DIM // value_block
    f32 = dict(dtype=torch.float32, device=q.device)
    dq_part = torch.empty(blocks, num_tokens, num_v_heads, head_dim, **f32)
    dk_part = torch.empty(blocks, num_tokens, num_v_heads, head_dim, **f32)
    dg_part = torch.empty(blocks, num_tokens, num_v_heads, **f32)
    dbeta_part = torch.empty(blocks, num_tokens, num_v_heads, **f32)
    dv = torch.empty(num_tokens, num_v_heads, head_dim, dtype=torch.bfloat16, device=q.device)
    dh0 = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, **f32)
    kernel = compile_fused_backward(value_block)
    kernel(q, k, v, g, beta, inverse, chunk_states, do, dht, cu_seqlens, offsets,
           dq_part, dk_part, dv, dg_part, dbeta_part, dh0, float(scale))
    return dq_part, dk_part, dv, dg_part, dbeta_part, dh0
