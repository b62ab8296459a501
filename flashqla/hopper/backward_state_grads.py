"""State gradients of the chunked gated delta rule: the sequential part of the backward.

The state gradient obeys its own reverse recurrence, independent of the forward states
(gdn-kernels.md section 3):

    dDelta = E K dS1 + Pm^T dO,   dU = -D Ab^T dDelta,   dS0 = e^{gamma_C} dS1 + Q^T (scale D dO) + K^T dU

One CTA per (V block, value head, sequence) walks the chunks in reverse with dS (K x BV, float32)
in registers, stores the gradient leaving every chunk (dS1, bf16) for the chunk-parallel kernel
(backward_fused.py), and writes dh0. Columns of dS are independent, so V blocks add parallelism
at no extra cost on the critical path.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import CHUNK_SIZE
from flashqla.hopper.cumsum import HOPPER_TARGET

_C = CHUNK_SIZE
_THREADS = 128
HEAD_DIM = 128


def state_grads_program(value_block: int = 32):
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
    def state_grads_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), op),
        k: T.Tensor((num_tokens, num_qk_heads, K), op),
        gamma: T.Tensor((num_tokens, num_v_heads), f32),
        beta: T.Tensor((num_tokens, num_v_heads), f32),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), op),
        do: T.Tensor((num_tokens, num_v_heads, V), op),
        dht: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        chunk_state_grads: T.Tensor((num_chunks, num_v_heads, K, V), op),
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
            do_s = T.alloc_shared((_C, BV), op)
            inv_s = T.alloc_shared((_C, _C), op)
            ds_s = T.alloc_shared((K, BV), op)
            pm_s = T.alloc_shared((_C, _C), op)
            ab_s = T.alloc_shared((_C, _C), op)
            d_delta_s = T.alloc_shared((_C, BV), op)
            du_s = T.alloc_shared((_C, BV), op)
            dog_s = T.alloc_shared((_C, BV), op)
            gam_s = T.alloc_shared((_C,), f32)
            b_s = T.alloc_shared((_C,), f32)

            ds = T.alloc_fragment((K, BV), f32)
            qk = T.alloc_fragment((_C, _C), f32)
            gm = T.alloc_fragment((_C, _C), f32)
            d_delta = T.alloc_fragment((_C, BV), f32)
            dw = T.alloc_fragment((_C, BV), f32)

            T.copy(dht[seq, head, 0:K, v0:v0 + BV], ds)
            for it in T.serial(seq_chunks):
                chunk = seq_chunks - 1 - it
                start = bos + chunk * _C
                last = T.min(eos - start, _C) - 1

                for t, d in T.Parallel(_C, K):
                    q_s[t, d] = T.if_then_else(t <= last, q[start + t, qk_head, d], T.cast(0, op))
                    k_s[t, d] = T.if_then_else(t <= last, k[start + t, qk_head, d], T.cast(0, op))
                for t, d in T.Parallel(_C, BV):
                    do_s[t, d] = T.if_then_else(t <= last, do[start + t, head, v0 + d], T.cast(0, op))
                for t, s in T.Parallel(_C, _C):
                    inv_s[t, s] = T.if_then_else(t <= last, inverse[start + t, head, s], T.cast(0, op))
                # Padded rows repeat the last gamma, so e^{gamma_C} is the decay over the real tokens.
                for t in T.Parallel(_C):
                    gam_s[t] = gamma[start + T.min(t, last), head]
                    b_s[t] = T.if_then_else(t <= last, beta[start + t, head], 0.0)
                for i, j in T.Parallel(K, BV):
                    ds_s[i, j] = T.cast(ds[i, j], op)
                T.copy(ds_s, chunk_state_grads[first_chunk + chunk, head, 0:K, v0:v0 + BV])

                for t, s in T.Parallel(_C, _C):
                    gm[t, s] = T.if_then_else(s <= t, T.exp(gam_s[t] - gam_s[s]), 0.0)
                T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(_C, _C):
                    pm_s[t, s] = T.cast(scale * qk[t, s] * gm[t, s], op)
                    ab_s[t, s] = T.cast(T.cast(inv_s[t, s], f32) * gm[t, s] * b_s[s], op)
                for t, d in T.Parallel(_C, BV):
                    dog_s[t, d] = T.cast(scale * T.exp(gam_s[t]) * T.cast(do_s[t, d], f32), op)

                T.gemm(k_s, ds_s, d_delta, clear_accum=True)
                for t, d in T.Parallel(_C, BV):
                    d_delta[t, d] = d_delta[t, d] * T.exp(gam_s[_C - 1] - gam_s[t])
                T.gemm(pm_s, do_s, d_delta, transpose_A=True)
                for t, d in T.Parallel(_C, BV):
                    d_delta_s[t, d] = T.cast(d_delta[t, d], op)
                T.gemm(ab_s, d_delta_s, dw, transpose_A=True, clear_accum=True)
                for t, d in T.Parallel(_C, BV):
                    du_s[t, d] = T.cast(-T.exp(gam_s[t]) * dw[t, d], op)
                for i, j in T.Parallel(K, BV):
                    ds[i, j] = ds[i, j] * T.exp(gam_s[_C - 1])
                T.gemm(q_s, dog_s, ds, transpose_A=True)
                T.gemm(k_s, du_s, ds, transpose_A=True)

            T.copy(ds, dh0[seq, head, 0:K, v0:v0 + BV])

    return state_grads_kernel


@functools.lru_cache(maxsize=None)
def compile_state_grads(value_block: int = 32):
    return tilelang.compile(state_grads_program(value_block), target=HOPPER_TARGET)


def state_gradients(q, k, gamma, beta, inverse, do, dht, scale, cu_seqlens, offsets, num_chunks, value_block):
    """(dS leaving every chunk, bf16 [num_chunks, Hv, 128, 128]; dh0, float32 [N, Hv, 128, 128]).

    q, k: [T, Hqk, 128] bf16; gamma (chunk-local cumsum), beta: [T, Hv] fp32; inverse: [T, Hv, 64] bf16;
    do: [T, Hv, 128] bf16; dht: [N, Hv, 128, 128] fp32; cu_seqlens, offsets: int32 [N + 1].
    """
    num_v_heads = do.shape[1]
    num_sequences = cu_seqlens.numel() - 1
    grads = torch.empty(max(num_chunks, 1), num_v_heads, HEAD_DIM, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    dh0 = torch.empty(num_sequences, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=q.device)
    compile_state_grads(value_block)(q, k, gamma, beta, inverse, do, dht, cu_seqlens, offsets, grads, dh0,
                                     float(scale))
    return grads, dh0
