"""The S-independent 64 x 64 matrices of every chunk, built in parallel before the fused forward's
sequential walk (docs/gdn-math.md §2.3), bf16 [T, Hv, 64] each:

    gated_inverse = Gm * A~ * beta_col   (Ab)
    scores        = scale * Gm * tril(Q K^T)   (P)

`gated_products` runs the grouped kernel of grouped_products.py wherever a qk head's group of
value heads fits it (Hv / Hqk <= 8), else the per-value-head kernel here.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, LOG2E, compile_for_hopper, dtype_name
from flashqla.hopper.grouped_products import MAX_GROUP_SIZE, MIN_BLOCKS_PER_SM, compile_grouped_products
from flashqla.hopper.inverse import make_inverse_into

_THREADS = 128
_C = CHUNK_SIZE


def gated_products_program(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    """One CTA per (chunk, value head): the gate-free solve of inverse.py, then Ab and P."""
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    inverse_into = make_inverse_into(head_dim, dtype)

    @T.prim_func
    def gated_products_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, head_dim), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, head_dim), dtype),
        gamma: T.Tensor((num_tokens, num_v_heads), "float32"),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_index: T.Tensor((num_chunks, 2), "int32"),
        gated_inverse: T.Tensor((num_tokens, num_v_heads, _C), dtype),
        scores: T.Tensor((num_tokens, num_v_heads, _C), dtype),
        scale: T.float32,
    ):
        with T.Kernel(num_chunks * num_v_heads, threads=_THREADS) as block:
            chunk = block // num_v_heads
            head = block % num_v_heads
            qk_head = head // (num_v_heads // num_qk_heads)
            sequence = chunk_index[chunk, 0]
            start = cu_seqlens[sequence] + chunk_index[chunk, 1] * _C
            length = T.min(cu_seqlens[sequence + 1] - start, _C)
            k_shared = T.alloc_shared((_C, head_dim), dtype)
            q_shared = T.alloc_shared((_C, head_dim), dtype)
            beta_shared = T.alloc_shared((_C,), "float32")
            gamma_shared = T.alloc_shared((_C,), "float32")
            x = T.alloc_shared((_C, _C), "float32")
            qk = T.alloc_fragment((_C, _C), "float32")
            ab_shared = T.alloc_shared((_C, _C), dtype)
            p_shared = T.alloc_shared((_C, _C), dtype)
            inverse_into(k, beta, k_shared, beta_shared, x, start, length, head, qk_head)
            for t, d in T.Parallel(_C, head_dim):
                q_shared[t, d] = T.if_then_else(t < length, q[start + t, qk_head, d], T.cast(0, dtype))
            for t in T.Parallel(_C):
                gamma_shared[t] = T.if_then_else(t < length, gamma[start + t, head], 0.0) * LOG2E
            T.gemm(q_shared, k_shared, qk, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                ab_shared[t, s] = T.if_then_else(
                    s <= t, T.exp2(gamma_shared[t] - gamma_shared[s]) * beta_shared[s] * x[t, s], 0.0)
                p_shared[t, s] = T.if_then_else(
                    s <= t, T.exp2(gamma_shared[t] - gamma_shared[s]) * scale * qk[t, s], 0.0)
            for i, j in T.Parallel(_C, _C):
                if i < length:
                    gated_inverse[start + i, head, j] = ab_shared[i, j]
                    scores[start + i, head, j] = p_shared[i, j]

    return gated_products_kernel


@functools.lru_cache(maxsize=None)
def compile_gated_products(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    return compile_for_hopper(gated_products_program(head_dim, dtype, beta_dtype), fast_math=True)


def gated_products(q: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, scale: float,
                   cu_seqlens: torch.Tensor, chunk_index: torch.Tensor, grouped: bool | None = None,
                   min_blocks_per_sm: int = MIN_BLOCKS_PER_SM, with_inverse: bool = False):
    """(gated_inverse, scores, inverse), each [T, Hv, 64] in q's dtype, on flattened inputs:
    q, k [T, Hqk, K]; gamma (fp32 chunk-local cumsum), beta [T, Hv]; cu_seqlens int32 [N+1].

    grouped=True runs grouped_products.py (one CTA per chunk and qk head, its value heads sharing
    the Q K^T and K K^T products; Hv / Hqk <= 8; min_blocks_per_sm is its register cap), the faster
    kernel; None picks it wherever the group fits, else the per-value-head kernel here.
    inverse: the gate-free inverse A~ when with_inverse asks for it and the grouped kernel ran
    (a by-product of its solve), else None.
    """
    num_tokens, num_v_heads = gamma.shape
    if grouped is None:
        grouped = num_v_heads // q.shape[1] <= MAX_GROUP_SIZE
    if grouped and num_v_heads // q.shape[1] > MAX_GROUP_SIZE:
        raise ValueError(f"gated_products(grouped=True) serves at most {MAX_GROUP_SIZE} value heads per qk head, "
                         f"got Hv={num_v_heads}, Hqk={q.shape[1]}")
    gated_inverse = torch.empty(num_tokens, num_v_heads, _C, dtype=q.dtype, device=q.device)
    scores = torch.empty_like(gated_inverse)
    write_inverse = with_inverse and grouped
    inverse = torch.empty((num_tokens if write_inverse else 1), num_v_heads, _C, dtype=q.dtype, device=q.device)
    if chunk_index.shape[0] > 0:
        dtypes = (dtype_name(q), dtype_name(beta))
        if grouped:
            kernel = compile_grouped_products(q.shape[-1], *dtypes, min_blocks_per_sm, write_inverse)
            kernel(q, k, gamma, beta, cu_seqlens, chunk_index, gated_inverse, scores, inverse, float(scale))
        else:
            kernel = compile_gated_products(q.shape[-1], *dtypes)
            kernel(q, k, gamma, beta, cu_seqlens, chunk_index, gated_inverse, scores, float(scale))
    return gated_inverse, scores, (inverse if write_inverse else None)
