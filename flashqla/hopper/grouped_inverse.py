"""The gate-free inverse of every chunk for Hv / Hqk <= 8: one CTA per (chunk, qk head) solving for its
whole value-head group (docs/gdn-math.md §2.3, §2.5):

    A~ = (I + StrictLower(diag(beta) K K^T))^-1,   bf16 (the inputs' dtype) [T, Hv, 64]

the one [T, Hv, 64] tensor the forward walk (fused_forward.py) builds its products from and the
backward reads. inverse.py solves the same per value head, for larger groups.

- k is loaded and K K^T computed once per qk head; the betas of the whole group in one pass.
- The solve has no serial shared-memory steps: each of 64 threads solves one column of one 16x16
  diagonal block in registers (D = blockdiag of the four inverses); then, with
  N = D * StrictBlockLower(L), A~ = D - N A~ is reached exactly by three steps Y <- D - N Y from
  Y = D (N^4 = 0), one tf32 mma product each. The diagonal blocks of N Y are exactly zero, so each
  step rewrites only the off-diagonal blocks of Y.
- ~45 KB of shared memory, 3 CTAs per SM.

No T.Pipelined loop: every load is a plain synchronous copy, so there is no producer to race with.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, compile_for_hopper, dtype_name

_THREADS = 128
_C = CHUNK_SIZE
_BLOCK = 16
_BLOCKS = _C // _BLOCK
# Y_{k+1} = D - N Y_k from Y_0 = D is exact at k = _BLOCKS - 1 because N is strictly block lower.
_ITERATIONS = _BLOCKS - 1
# Register cap as CTAs per SM: 3 beat 4 on the H200 when this kernel also made the products.
MIN_BLOCKS_PER_SM = 3
# Largest Hv / Hqk served: the group's betas sit in shared memory.
MAX_GROUP_SIZE = 8


def grouped_inverse_program(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32",
                            min_blocks_per_sm: int = MIN_BLOCKS_PER_SM):
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")

    @T.prim_func
    def grouped_inverse_kernel(
        k: T.Tensor((num_tokens, num_qk_heads, head_dim), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_index: T.Tensor((num_chunks, 2), "int32"),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), dtype),
    ):
        with T.Kernel(num_chunks * num_qk_heads, threads=_THREADS) as block:
            chunk = block // num_qk_heads
            qk_head = block % num_qk_heads
            group_size = num_v_heads // num_qk_heads
            sequence = chunk_index[chunk, 0]
            start = cu_seqlens[sequence] + chunk_index[chunk, 1] * _C
            length = T.min(cu_seqlens[sequence + 1] - start, _C)
            thread = T.get_thread_binding()

            T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            k_shared = T.alloc_shared((_C, head_dim), dtype)
            gram = T.alloc_fragment((_C, _C), "float32")
            beta_group = T.alloc_shared((MAX_GROUP_SIZE, _C), "float32")
            # The solving head's betas: indexed by a run-time head, the group array makes TileLang's
            # sync planner put a barrier inside every loop that reads it and writes shared memory.
            beta_shared = T.alloc_shared((_C,), "float32")
            # Plain layout for the per-thread column solve. Its writes into rhs by thread index go
            # through rhs's swizzled layout like every other access (TileLang remaps them all).
            diag_lower = T.alloc_shared((_BLOCKS, _BLOCK, _BLOCK), "float32")
            diag_inverse = T.alloc_shared((_BLOCKS, _BLOCK, _BLOCK), "float32")
            column = T.alloc_local((_BLOCK,), "float32")
            lhs = T.alloc_shared((_C, _C), "float32")   # D, then N
            rhs = T.alloc_shared((_C, _C), "float32")   # L off the diagonal blocks and D on them, then Y
            product = T.alloc_fragment((_C, _C), "float32")
            out_shared = T.alloc_shared((_C, _C), dtype)

            for t, d in T.Parallel(_C, head_dim):
                k_shared[t, d] = T.if_then_else(t < length, k[start + t, qk_head, d], T.cast(0, dtype))
            for member, t in T.Parallel(MAX_GROUP_SIZE, _C):
                beta_group[member, t] = T.if_then_else(
                    (member < group_size) & (t < length),
                    T.cast(beta[start + t, qk_head * group_size + member], "float32"), 0.0)
            T.gemm(k_shared, k_shared, gram, transpose_B=True, clear_accum=True)

            for member in T.serial(group_size):
                head = qk_head * group_size + member
                for t in T.Parallel(_C):
                    beta_shared[t] = beta_group[member, t]
                # L = StrictLower(diag(beta) K K^T): its diagonal blocks to diag_lower, the rest to rhs.
                # rhs's diagonal blocks get D from the solve: D L keeps only blocks below the diagonal,
                # D_ii L_ij, which do not read them, and D is where the iteration starts.
                for i, j in T.Parallel(_C, _C):
                    if i // _BLOCK == j // _BLOCK:
                        diag_lower[i // _BLOCK, i % _BLOCK, j % _BLOCK] = T.if_then_else(
                            j < i, beta_shared[i] * gram[i, j], 0.0)
                    else:
                        rhs[i, j] = T.if_then_else(j < i, beta_shared[i] * gram[i, j], 0.0)
                # Column c of (I + L_bb)^-1 by forward substitution, in one thread's registers.
                diag = thread // _BLOCK
                col = thread % _BLOCK
                if thread < _C:
                    for i in T.unroll(_BLOCK):
                        column[i] = T.if_then_else(i == col, 1.0, 0.0)
                        for j in T.unroll(i):
                            column[i] = column[i] - diag_lower[diag, i, j] * column[j]
                    for i in T.unroll(_BLOCK):
                        diag_inverse[diag, i, col] = column[i]
                        rhs[diag * _BLOCK + i, diag * _BLOCK + col] = column[i]
                for i, j in T.Parallel(_C, _C):
                    lhs[i, j] = T.if_then_else(
                        i // _BLOCK == j // _BLOCK, diag_inverse[i // _BLOCK, i % _BLOCK, j % _BLOCK], 0.0)
                # Below the diagonal blocks D L is N = D * StrictBlockLower(L) (D is block diagonal).
                T.gemm(lhs, rhs, product, clear_accum=True)
                for i, j in T.Parallel(_C, _C):
                    lhs[i, j] = T.if_then_else(i // _BLOCK > j // _BLOCK, product[i, j], 0.0)
                    if i // _BLOCK != j // _BLOCK:
                        rhs[i, j] = 0.0  # rhs = Y_0 = D
                for _ in T.serial(_ITERATIONS - 1):
                    T.gemm(lhs, rhs, product, clear_accum=True)
                    for i, j in T.Parallel(_C, _C):
                        if i // _BLOCK != j // _BLOCK:
                            rhs[i, j] = -product[i, j]
                # Last iteration: A~ = D - N Y.
                T.gemm(lhs, rhs, product, clear_accum=True)
                for t, s in T.Parallel(_C, _C):
                    out_shared[t, s] = T.if_then_else(
                        s <= t,
                        T.if_then_else(t // _BLOCK == s // _BLOCK,
                                       diag_inverse[t // _BLOCK, t % _BLOCK, s % _BLOCK], 0.0) - product[t, s],
                        0.0)
                for i, j in T.Parallel(_C, _C):
                    if i < length:
                        inverse[start + i, head, j] = out_shared[i, j]

    return grouped_inverse_kernel


@functools.lru_cache(maxsize=None)
def compile_grouped_inverse(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32",
                            min_blocks_per_sm: int = MIN_BLOCKS_PER_SM):
    program = grouped_inverse_program(head_dim, dtype, beta_dtype, min_blocks_per_sm)
    return compile_for_hopper(program, fast_math=True)


def grouped_inverse(k: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, chunk_index: torch.Tensor) -> torch.Tensor:
    """A~ of every chunk and value head, [T, Hv, 64] in k's dtype: k [T, Hqk, K], beta [T, Hv]
    (Hv / Hqk <= MAX_GROUP_SIZE), cu_seqlens int32 [N + 1], chunk_index from chunk_plan.chunk_indices."""
    num_tokens, num_qk_heads, head_dim = k.shape
    num_v_heads = beta.shape[1]
    if num_v_heads // num_qk_heads > MAX_GROUP_SIZE:
        raise ValueError(f"grouped_inverse serves at most {MAX_GROUP_SIZE} value heads per qk head, "
                         f"got Hv={num_v_heads}, Hqk={num_qk_heads}")
    inverse = torch.empty(num_tokens, num_v_heads, _C, dtype=k.dtype, device=k.device)
    if chunk_index.shape[0] > 0:
        kernel = compile_grouped_inverse(head_dim, dtype_name(k), dtype_name(beta))
        kernel(k, beta, cu_seqlens, chunk_index, inverse)
    return inverse
