"""The gated products for Hv / Hqk <= 8: one CTA per (chunk, qk head) serving its whole value-head group.

Same outputs as the per-value-head kernel of gated_products.py (bf16 [T, Hv, 64] each):

    gated_inverse = Gm * A~ * beta_col,   A~ = (I + StrictLower(diag(beta) K K^T))^-1
    scores        = scale * Gm * tril(Q K^T)

What changes (docs/kernel-notes.md, "Grouped products"):
- k and q are loaded, and K K^T and Q K^T computed, once per qk head instead of once per value
  head; the decays and betas of the whole group are loaded in one pass.
- Scores for every head of the group first (only Q K^T held), then the solves (only K K^T held).
- The solve has no serial shared-memory steps: each of 64 threads solves one column of one 16x16
  diagonal block in registers (D = blockdiag of the four inverses); then, with
  N = D * StrictBlockLower(L), A~ = D - N A~ is reached exactly by three steps Y <- D - N Y from
  Y = D (N^4 = 0; docs/gdn-math.md §2.5), one tf32 mma product each. The diagonal blocks of N Y are exactly zero, so each
  step rewrites only the off-diagonal blocks of Y.
- ~53 KB of shared memory (k and q share their space with the solve's buffers), 3 CTAs per SM.
- On request it also stores A~ itself, which the backward needs (saves recomputing it there).

No T.Pipelined loop: every load is a plain synchronous copy, so there is no producer to race with.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, LOG2E, compile_for_hopper, dtype_name

_THREADS = 128
_C = CHUNK_SIZE
_BLOCK = 16
_BLOCKS = _C // _BLOCK
# Y_{k+1} = D - N Y_k from Y_0 = D is exact at k = _BLOCKS - 1 because N is strictly block lower.
_ITERATIONS = _BLOCKS - 1
# Register cap as CTAs per SM: 3 beat 4 on the H200 on four of five head layouts at 1x32768
# (16/64: 1.502 vs 1.605 ms; 16/16 tied).
MIN_BLOCKS_PER_SM = 3
# Largest Hv / Hqk served: the group's decays and betas sit in shared memory (4 KB at 8).
MAX_GROUP_SIZE = 8


def grouped_products_program(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32",
                             min_blocks_per_sm: int = MIN_BLOCKS_PER_SM, write_inverse: bool = False,
                             write_products: bool = True):
    """min_blocks_per_sm caps registers for that many resident CTAs (4: 128 registers, ~112 bytes
    spilled; 3: 168, none); the device test times both. write_inverse: also store the gate-free
    inverse A~ itself (the backward reads it), else `inverse` may be a [1, Hv, 64] placeholder.
    write_products=False stores A~ only (q is not read; gated_inverse and scores may be [1, Hv, 64]
    placeholders): what the forward walk of fused_forward_onchip.py builds its products from."""
    write_inverse = write_inverse or not write_products
    num_tokens = T.dynamic("num_tokens")
    inverse_rows = T.dynamic("inverse_rows")
    product_rows = T.dynamic("product_rows")
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
        gated_inverse: T.Tensor((product_rows, num_v_heads, _C), dtype),
        scores: T.Tensor((product_rows, num_v_heads, _C), dtype),
        inverse: T.Tensor((inverse_rows, num_v_heads, _C), dtype),
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

            # 4 CTAs of ~53 KB shared memory fit an SM; ask ptxas for the registers to match.
            T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            k_shared = T.alloc_shared((_C, head_dim), dtype)
            q_shared = T.alloc_shared((_C, head_dim), dtype)
            gram = T.alloc_fragment((_C, _C), "float32")
            qk = T.alloc_fragment((_C, _C), "float32")
            # Decays (log2 units) and betas of every head of the group, loaded in one pass.
            gamma_group = T.alloc_shared((MAX_GROUP_SIZE, _C), "float32")
            beta_group = T.alloc_shared((MAX_GROUP_SIZE, _C), "float32")
            # The solving head's row of each: indexed by a run-time head, the group arrays make
            # TileLang's sync planner put a barrier inside every loop that reads them and writes shared.
            gamma_shared = T.alloc_shared((_C,), "float32")
            beta_shared = T.alloc_shared((_C,), "float32")
            # Plain layout for the per-thread column solve. Its writes into rhs by thread index go
            # through rhs's swizzled layout like every other access (TileLang remaps them all).
            diag_lower = T.alloc_shared((_BLOCKS, _BLOCK, _BLOCK), "float32")
            diag_inverse = T.alloc_shared((_BLOCKS, _BLOCK, _BLOCK), "float32")
            column = T.alloc_local((_BLOCK,), "float32")
            lhs = T.alloc_shared((_C, _C), "float32")   # D, then N
            rhs = T.alloc_shared((_C, _C), "float32")   # L off the diagonal blocks and D on them, then Y
            product = T.alloc_fragment((_C, _C), "float32")
            out_shared = T.alloc_shared((_C, _C), dtype)  # one head's scores, later one head's Ab

            for t, d in T.Parallel(_C, head_dim):
                k_shared[t, d] = T.if_then_else(t < length, k[start + t, qk_head, d], T.cast(0, dtype))
            if write_products:
                for t, d in T.Parallel(_C, head_dim):
                    q_shared[t, d] = T.if_then_else(t < length, q[start + t, qk_head, d], T.cast(0, dtype))
            for member, t in T.Parallel(MAX_GROUP_SIZE, _C):
                in_group = (member < group_size) & (t < length)
                if write_products:
                    gamma_group[member, t] = T.if_then_else(
                        in_group, gamma[start + t, qk_head * group_size + member], 0.0) * LOG2E
                beta_group[member, t] = T.if_then_else(
                    in_group, T.cast(beta[start + t, qk_head * group_size + member], "float32"), 0.0)
            T.gemm(k_shared, k_shared, gram, transpose_B=True, clear_accum=True)
            if write_products:
                T.gemm(q_shared, k_shared, qk, transpose_B=True, clear_accum=True)

            # Scores of the whole group first, so Q K^T and K K^T are never both held in registers.
            for member in T.serial(group_size if write_products else 0):
                head = qk_head * group_size + member
                for t, s in T.Parallel(_C, _C):
                    out_shared[t, s] = T.if_then_else(
                        s <= t, T.exp2(gamma_group[member, t] - gamma_group[member, s]) * scale * qk[t, s], 0.0)
                for i, j in T.Parallel(_C, _C):
                    if i < length:
                        scores[start + i, head, j] = out_shared[i, j]

            for member in T.serial(group_size):
                head = qk_head * group_size + member
                for t in T.Parallel(_C):
                    beta_shared[t] = beta_group[member, t]
                if write_products:
                    for t in T.Parallel(_C):
                        gamma_shared[t] = gamma_group[member, t]
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
                T.gemm(lhs, rhs, product, clear_accum=True)
                if write_inverse:
                    for t, s in T.Parallel(_C, _C):
                        out_shared[t, s] = T.if_then_else(
                            s <= t,
                            T.if_then_else(t // _BLOCK == s // _BLOCK,
                                           diag_inverse[t // _BLOCK, t % _BLOCK, s % _BLOCK], 0.0) - product[t, s],
                            0.0)
                    for i, j in T.Parallel(_C, _C):
                        if i < length:
                            inverse[start + i, head, j] = out_shared[i, j]
                # Last iteration: A~ = D - N Y straight into the gated, beta-scaled output.
                if write_products:
                    for t, s in T.Parallel(_C, _C):
                        out_shared[t, s] = T.if_then_else(
                            s <= t,
                            T.exp2(gamma_shared[t] - gamma_shared[s]) * beta_shared[s] * (T.if_then_else(
                                t // _BLOCK == s // _BLOCK, diag_inverse[t // _BLOCK, t % _BLOCK, s % _BLOCK], 0.0)
                                - product[t, s]),
                            0.0)
                    for i, j in T.Parallel(_C, _C):
                        if i < length:
                            gated_inverse[start + i, head, j] = out_shared[i, j]

    return grouped_products_kernel


@functools.lru_cache(maxsize=None)
def compile_grouped_products(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32",
                             min_blocks_per_sm: int = MIN_BLOCKS_PER_SM, write_inverse: bool = False,
                             write_products: bool = True):
    program = grouped_products_program(head_dim, dtype, beta_dtype, min_blocks_per_sm, write_inverse, write_products)
    return compile_for_hopper(program, fast_math=True)


def grouped_inverse(k: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                    chunk_index: torch.Tensor) -> torch.Tensor:
    """The gate-free inverse A~ of every chunk and value head, [T, Hv, 64] in k's dtype, by the grouped
    kernel's solve alone (Hv / Hqk <= MAX_GROUP_SIZE): k [T, Hqk, K]; gamma (not read, it only
    fixes the shapes), beta [T, Hv]."""
    num_tokens, num_qk_heads, head_dim = k.shape
    num_v_heads = beta.shape[1]
    if num_v_heads // num_qk_heads > MAX_GROUP_SIZE:
        raise ValueError(f"grouped_inverse serves at most {MAX_GROUP_SIZE} value heads per qk head, "
                         f"got Hv={num_v_heads}, Hqk={num_qk_heads}")
    inverse = torch.empty(num_tokens, num_v_heads, _C, dtype=k.dtype, device=k.device)
    if chunk_index.shape[0] > 0:
        placeholder = torch.empty(1, num_v_heads, _C, dtype=k.dtype, device=k.device)
        kernel = compile_grouped_products(head_dim, dtype_name(k), dtype_name(beta), write_products=False)
        kernel(k, k, gamma, beta, cu_seqlens, chunk_index, placeholder, placeholder, inverse, 1.0)
    return inverse
