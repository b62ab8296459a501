"""Candidate for inverse.gated_products: one CTA per (chunk, qk head) serving its whole value-head group.

Same outputs as inverse.gated_products_program (bf16 [T, Hv, 64] each):

    gated_inverse = Gm * A~ * beta_col,   A~ = (I + StrictLower(diag(beta) K K^T))^-1
    scores        = scale * Gm * tril(Q K^T)

What changes (docs/kernel-notes.md, "grouped products candidate"):
- k and q are loaded, and K K^T and Q K^T computed, once per qk head instead of once per value head.
- The solve has no serial shared-memory steps: each of 64 threads solves one column of one 16x16
  diagonal block in registers (D = blockdiag of the four inverses), then, with
  N = D * StrictBlockLower(L), A~ = D - N A~ is exact after three iterations Y <- D - N Y from Y = D
  (N^4 = 0), one tf32 tensor-core product each.
- Fewer shared buffers: the left operand holds D then N, the right operand L then Y.

Not yet run on a GPU: selected by inverse.gated_products(..., grouped=True), never by default.
"""

import functools

import tilelang
import tilelang.language as T

from flashqla.hopper.chunk_plan import CHUNK_SIZE
from flashqla.hopper.cumsum import HOPPER_TARGET

_THREADS = 128
_LOG2E = 1.4426950408889634
_C = CHUNK_SIZE
_BLOCK = 16
_BLOCKS = _C // _BLOCK
# Y_{k+1} = D - N Y_k from Y_0 = D is exact at k = _BLOCKS - 1 because N is strictly block lower.
_ITERATIONS = _BLOCKS - 1


def grouped_products_program(head_dim: int = 128, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")

    @T.prim_func
    def grouped_products_kernel(
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
        with T.Kernel(num_chunks * num_qk_heads, threads=_THREADS) as block:
            chunk = block // num_qk_heads
            qk_head = block % num_qk_heads
            group_size = num_v_heads // num_qk_heads
            sequence = chunk_index[chunk, 0]
            start = cu_seqlens[sequence] + chunk_index[chunk, 1] * _C
            length = T.min(cu_seqlens[sequence + 1] - start, _C)
            thread = T.get_thread_binding()

            k_shared = T.alloc_shared((_C, head_dim), dtype)
            q_shared = T.alloc_shared((_C, head_dim), dtype)
            gram = T.alloc_fragment((_C, _C), "float32")
            qk = T.alloc_fragment((_C, _C), "float32")
            beta_shared = T.alloc_shared((_C,), "float32")
            gamma_shared = T.alloc_shared((_C,), "float32")
            # Plain (un-swizzled) copies for the per-thread column solve; the operands below are
            # only touched by T.gemm and T.Parallel, which agree on their swizzled layout.
            diag_lower = T.alloc_shared((_BLOCKS, _BLOCK, _BLOCK), "float32")
            diag_inverse = T.alloc_shared((_BLOCKS, _BLOCK, _BLOCK), "float32")
            column = T.alloc_local((_BLOCK,), "float32")
            lhs = T.alloc_shared((_C, _C), "float32")   # D, then N
            rhs = T.alloc_shared((_C, _C), "float32")   # L, then Y
            product = T.alloc_fragment((_C, _C), "float32")
            ab_shared = T.alloc_shared((_C, _C), dtype)
            p_shared = T.alloc_shared((_C, _C), dtype)

            for t, d in T.Parallel(_C, head_dim):
                k_shared[t, d] = T.if_then_else(t < length, k[start + t, qk_head, d], T.cast(0, dtype))
                q_shared[t, d] = T.if_then_else(t < length, q[start + t, qk_head, d], T.cast(0, dtype))
            T.gemm(k_shared, k_shared, gram, transpose_B=True, clear_accum=True)
            T.gemm(q_shared, k_shared, qk, transpose_B=True, clear_accum=True)

            for member in T.serial(group_size):
                head = qk_head * group_size + member
                for t in T.Parallel(_C):
                    beta_shared[t] = T.if_then_else(t < length, T.cast(beta[start + t, head], "float32"), 0.0)
                    gamma_shared[t] = T.if_then_else(t < length, gamma[start + t, head], 0.0) * _LOG2E
                # L = StrictLower(diag(beta) K K^T): whole in rhs, its diagonal blocks also in diag_lower.
                for i, j in T.Parallel(_C, _C):
                    rhs[i, j] = T.if_then_else(j < i, beta_shared[i] * gram[i, j], 0.0)
                    if i // _BLOCK == j // _BLOCK:
                        diag_lower[i // _BLOCK, i % _BLOCK, j % _BLOCK] = T.if_then_else(
                            j < i, beta_shared[i] * gram[i, j], 0.0)
                # Column c of (I + L_bb)^-1 by forward substitution, in one thread's registers.
                if thread < _C:
                    diag = thread // _BLOCK
                    col = thread % _BLOCK
                    for i in T.unroll(_BLOCK):
                        column[i] = T.if_then_else(i == col, 1.0, 0.0)
                        for j in T.unroll(i):
                            column[i] = column[i] - diag_lower[diag, i, j] * column[j]
                    for i in T.unroll(_BLOCK):
                        diag_inverse[diag, i, col] = column[i]
                for i, j in T.Parallel(_C, _C):
                    lhs[i, j] = T.if_then_else(
                        i // _BLOCK == j // _BLOCK, diag_inverse[i // _BLOCK, i % _BLOCK, j % _BLOCK], 0.0)
                # D L has N = D * StrictBlockLower(L) off the diagonal blocks (D is block diagonal).
                T.gemm(lhs, rhs, product, clear_accum=True)
                for i, j in T.Parallel(_C, _C):
                    lhs[i, j] = T.if_then_else(i // _BLOCK > j // _BLOCK, product[i, j], 0.0)
                    rhs[i, j] = T.if_then_else(
                        i // _BLOCK == j // _BLOCK, diag_inverse[i // _BLOCK, i % _BLOCK, j % _BLOCK], 0.0)
                for _ in T.serial(_ITERATIONS - 1):
                    T.gemm(lhs, rhs, product, clear_accum=True)
                    for i, j in T.Parallel(_C, _C):
                        rhs[i, j] = T.if_then_else(
                            i // _BLOCK == j // _BLOCK, diag_inverse[i // _BLOCK, i % _BLOCK, j % _BLOCK], 0.0
                        ) - product[i, j]
                T.gemm(lhs, rhs, product, clear_accum=True)
                # Last iteration: A~ = D - N Y straight into the gated, beta-scaled bf16 output.
                for t, s in T.Parallel(_C, _C):
                    ab_shared[t, s] = T.if_then_else(
                        s <= t,
                        T.exp2(gamma_shared[t] - gamma_shared[s]) * beta_shared[s] * (T.if_then_else(
                            t // _BLOCK == s // _BLOCK, diag_inverse[t // _BLOCK, t % _BLOCK, s % _BLOCK], 0.0)
                            - product[t, s]),
                        0.0)
                # Q K^T came from a wgmma, the products above from tf32 mma: different fragment layouts.
                for t, s in T.Parallel(_C, _C):
                    p_shared[t, s] = T.if_then_else(
                        s <= t, T.exp2(gamma_shared[t] - gamma_shared[s]) * scale * qk[t, s], 0.0)
                for i, j in T.Parallel(_C, _C):
                    if i < length:
                        gated_inverse[start + i, head, j] = ab_shared[i, j]
                        scores[start + i, head, j] = p_shared[i, j]

    return grouped_products_kernel


@functools.lru_cache(maxsize=None)
def compile_grouped_products(head_dim: int = 128, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    program = grouped_products_program(head_dim, dtype, beta_dtype)
    return tilelang.compile(program, target=HOPPER_TARGET,
                            pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
