"""The gate-free inverse of every chunk (docs/gdn-math.md §2.3, §2.5), and gamma beside it:

    A~ = (I + L)^-1,   L = StrictLower(diag(beta) K K^T),   [T, Hv, 64] in k's dtype
    gamma_t = g_1 + ... + g_t from the chunk's start (§2.1),  [T, Hv] float32

the tensors the forward walk (fused_forward.py) builds its products from and the backward reads.
One CTA of 128 threads per (chunk, value head), solving by blocks, 16 -> 32 -> 64:

1. K K^T on tensor cores (bf16); L to shared memory in one pass, each level reading its blocks there.
2. The four 16x16 diagonal blocks D_b = (I + L_bb)^-1: 64 threads, each one column by forward
   substitution in its registers.
3. The lower-left 16x16 block of each 32x32 diagonal block: -D_{2p+1} L_{2p+1,2p} D_{2p} (CUDA cores).
4. The lower-left 32x32 block: -A~_B L_BA A~_A, with A~_A, A~_B the 32x32 diagonal blocks (two tf32
   products on tensor cores).
gamma is a warp-wide scan, made while the column solves run on two other warps: one launch fewer than a
kernel of its own (docs/kernel-notes.md, twenty-fourth and twenty-fifth sessions).

About 80k multiply-adds a chunk besides K K^T, where iterating Y <- D - N Y on whole 64x64 blocks
takes 1M; small shared memory, so that MIN_BLOCKS_PER_SM CTAs share an SM and hide each other's
loads. Each CTA reads its chunk's (first token, length) from the plan's chunk bounds: two independent loads,
not a chunk index -> cu_seqlens chain. k arrives by one TMA load, waited for before its first read; no
T.Pipelined loop, so there is no producer to race with. Per-thread work is kept to few instructions (8 CTAs
of 4 warps an SM issue on about half the cycles): k's tile by TMA, four sums a thread in step 3
(docs/kernel-notes.md, twenty-fifth session).

normalize_qk (the op's use_qk_l2norm_in_kernel): the same kernel makes the L2 norm's r of q and k and
writes only r (4 bytes a row): the walk and the backward read q and k as given and apply r where they
enter products, so q^ and k^ never go through memory. The group's first member reads q from global memory
while k's tile loads; every member normalises its k tile in shared memory before K K^T (A~ is that of k^).
The l2norm kernel's arithmetic in its order, so the same r and k^ bits (docs/kernel-notes.md, twenty-sixth
and twenty-seventh sessions).
"""

import functools
from types import SimpleNamespace

import tilelang.language as T
import torch

from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, compile_for_hopper, dtype_name
from flashqla.hopper.l2norm import EPS

_THREADS = 128
_C = CHUNK_SIZE
_BLOCK = 16
_HALF = _C // 2
# Eight CTAs an SM (registers <= 64 a thread, 27 KB of shared memory each): 32 warps hide each other's loads.
MIN_BLOCKS_PER_SM = 8
# normalize_qk: a row's 128 elements over 16 threads of 8 (one 16-byte load each), 8 rows a pass
_NORM_VECTOR = 8
_NORM_LANES = HEAD_DIM // _NORM_VECTOR
_NORM_ROWS = _THREADS // _NORM_LANES
_NORM_PASSES = _C // _NORM_ROWS


def inverse_program(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32",
                    g_dtype: str = "float32", min_blocks_per_sm: int = MIN_BLOCKS_PER_SM, normalize_qk: bool = False):
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    qk_shape = (num_tokens, num_qk_heads, head_dim)

    @T.macro
    def row_rstds(values, rstd, thread, start, length, qk_head, rstd_out, write):
        """rstd[p] <- r of this thread's pass-p row (values: its 8 elements of rows thread // 16 + 8 p of a
        chunk's 64); with `write`, r of rows < length to rstd_out [T, Hqk]. The l2norm kernel's arithmetic in
        its order (sequential squares, then the shuffles), so the same bits as it."""
        for p in T.unroll(_NORM_PASSES):
            rstd[p] = 0.0
            for j in T.unroll(_NORM_VECTOR):
                rstd[p] = rstd[p] + T.cast(values[p, j], "float32") * T.cast(values[p, j], "float32")
            for o in T.unroll(4):
                rstd[p] = rstd[p] + T.shfl_xor(rstd[p], (_NORM_LANES // 2) >> o)
            rstd[p] = T.rsqrt(rstd[p] + EPS)
        if write:
            for p in T.unroll(_NORM_PASSES):
                if p * _NORM_ROWS + thread // _NORM_LANES < length and thread % _NORM_LANES == 0:
                    rstd_out[start + p * _NORM_ROWS + thread // _NORM_LANES, qk_head] = rstd[p]

    @T.macro
    def body(k, g, beta, chunk_bounds, gamma, inverse, norm):
        # Value heads of one chunk are neighbours in the grid: a qk head's group reads its k tile from L2.
        # The group member as a grid axis of its own: no integer division by a run-time group size.
        group = num_v_heads // num_qk_heads
        with T.Kernel(group, num_qk_heads, num_chunks, threads=_THREADS) as (member, qk_head, chunk):
            # Held in variables: an expression is inlined into every index, as 64-bit divisions there.
            head = T.alloc_var("int32")
            start = T.alloc_var("int32")
            length = T.alloc_var("int32")
            head = qk_head * group + member
            start = chunk_bounds[chunk, 0]
            length = chunk_bounds[chunk, 1]
            thread = T.get_thread_binding()

            T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            k_shared = T.alloc_shared((_C, head_dim), dtype)
            k_loaded = T.alloc_barrier([1])
            beta_shared = T.alloc_shared((_C,), "float32")
            g_shared = T.alloc_shared((_C,), "float32")
            gamma_shared = T.alloc_shared((_C,), "float32")
            running = T.alloc_var("float32")
            shifted = T.alloc_var("float32")
            first = T.alloc_var("float32")
            gram = T.alloc_fragment((_C, _C), "float32")
            # beta_i (K K^T)_ij, whole: each level reads its blocks below the diagonal here
            lower = T.alloc_shared((_C, _C), "float32")
            diag_inverse = T.alloc_shared((4, _BLOCK, _BLOCK), "float32")     # D_b
            merge = T.alloc_shared((2, _BLOCK, _BLOCK), "float32")            # L_{2p+1,2p} D_{2p}
            column = T.alloc_local((_BLOCK,), "float32")
            sums = T.alloc_local((4,), "float32")
            left = T.alloc_var("float32")
            # Operands of the 32x32 products (TileLang lays them out for the tensor cores).
            cross_lower = T.alloc_shared((_HALF, _HALF), "float32")   # -L_BA = -L[32:, :32]
            # quarters[0] = A~_A = A~[:32, :32], quarters[1] = A~_B = A~[32:, 32:], quarters[2] = -L_BA A~_A:
            # in L's bytes, once the last read of L is over
            quarters = T.view(lower, (4, _HALF, _HALF))
            corner = T.alloc_fragment((_HALF, _HALF), "float32")
            out_shared = T.alloc_shared((_C, _C), dtype)
            if norm is not None:
                rows = T.alloc_local((_NORM_PASSES, _NORM_VECTOR), dtype)
                rstd = T.alloc_local((_NORM_PASSES,), "float32")
                norm_col = thread % _NORM_LANES * _NORM_VECTOR

            # The whole tile by TMA: rows past the chunk's end (the next sequence's k, or TMA's zeros past the
            # tensor) reach only rows of K K^T that beta = 0 clears and entries above the diagonal, which no
            # step reads. Per-thread masked loads took 250 of the kernel's 1536 instructions (SASS).
            T.tma_copy(k[start:start + _C, qk_head, 0:head_dim], k_shared, barrier=k_loaded[0])
            if T.shuffle_elect(_THREADS):
                T.barrier_arrive(k_loaded[0])
            # r of q, by the group's first member while k's tile loads. Rows past the tensor read its last row:
            # every lane of a warp takes part in the shuffles, and only rows < length are written.
            if norm is not None:
                if member == 0:
                    for p in T.unroll(_NORM_PASSES):
                        for j in T.vectorized(_NORM_VECTOR):
                            rows[p, j] = norm.q[T.min(start + p * _NORM_ROWS + thread // _NORM_LANES, num_tokens - 1),
                                                qk_head, norm_col + j]
                    row_rstds(rows, rstd, thread, start, length, qk_head, norm.q_rstd, True)
            for t in T.Parallel(_C):
                beta_shared[t] = T.if_then_else(t < length, T.cast(beta[start + t, head], "float32"), 0.0)
                g_shared[t] = T.if_then_else(t < length, T.cast(g[start + t, head], "float32"), 0.0)
            T.mbarrier_wait_parity(k_loaded[0], 0)
            # k's L2 norm in place in shared memory (every member for its own K K^T); the first member writes r.
            if norm is not None:
                for p in T.unroll(_NORM_PASSES):
                    for j in T.vectorized(_NORM_VECTOR):
                        rows[p, j] = k_shared[p * _NORM_ROWS + thread // _NORM_LANES, norm_col + j]
                row_rstds(rows, rstd, thread, start, length, qk_head, norm.k_rstd, member == 0)
                for p in T.unroll(_NORM_PASSES):
                    for j in T.vectorized(_NORM_VECTOR):
                        k_shared[p * _NORM_ROWS + thread // _NORM_LANES, norm_col + j] = T.cast(
                            T.cast(rows[p, j], "float32") * rstd[p], dtype)
                T.fence_proxy_async()
                T.sync_threads()
            T.gemm(k_shared, k_shared, gram, transpose_B=True, clear_accum=True)

            # 1. L = beta_i (K K^T)_ij in one plain pass over the fragment (the later steps read only its
            # strictly lower part, so nothing is masked); -L_BA = -L[32:, :32] as a tile of the tf32 product.
            for i, j in T.Parallel(_C, _C):
                lower[i, j] = beta_shared[i] * gram[i, j]
            for i, j in T.Parallel(_HALF, _HALF):
                cross_lower[i, j] = -lower[_HALF + i, j]

            # gamma: a scan by warp 2 (idle during the solves), two tokens a lane: the pair's sum, an inclusive
            # scan of the pairs by shuffles, the previous lane's total below the pair. A chain of 6 shuffles where
            # one thread's running sum was 64 additions (0.4-0.9 % of the kernel: docs/kernel-notes.md).
            if thread // 32 == 2:
                lane = thread % 32
                first = g_shared[2 * lane]
                running = first + g_shared[2 * lane + 1]
                for o in T.unroll(5):
                    shifted = T.shfl_up(running, 1 << o)
                    running = running + T.if_then_else(lane >= (1 << o), shifted, 0.0)
                shifted = T.shfl_up(running, 1)
                gamma_shared[2 * lane] = T.if_then_else(lane > 0, shifted, 0.0) + first
                gamma_shared[2 * lane + 1] = running

            # 2. Column `col` of D_diag, by forward substitution in one thread's registers.
            diag = thread // _BLOCK
            col = thread % _BLOCK
            if thread < 4 * _BLOCK:
                for i in T.unroll(_BLOCK):
                    column[i] = T.if_then_else(i == col, 1.0, 0.0)
                    for j in T.unroll(i):
                        column[i] = column[i] - lower[diag * _BLOCK + i, diag * _BLOCK + j] * column[j]
                for i in T.unroll(_BLOCK):
                    diag_inverse[diag, i, col] = column[i]

            # 3. The 32x32 diagonal blocks: D on their diagonal, zero above, -D_{2p+1} L_{2p+1,2p} D_{2p} below.
            # A thread a (block p, row, four columns): one left operand serves four sums, and the right ones
            # are four neighbours (a quarter of the shared loads of one thread per entry).
            block = thread // (4 * _BLOCK)
            row = thread // 4 % _BLOCK
            cols = thread % 4 * 4
            T.clear(sums)
            for r in T.unroll(_BLOCK):
                left = lower[(2 * block + 1) * _BLOCK + row, 2 * block * _BLOCK + r]
                for c in T.vectorized(4):
                    sums[c] = sums[c] + left * diag_inverse[2 * block, r, cols + c]
            for c in T.vectorized(4):
                merge[block, row, cols + c] = sums[c]
            for i, j in T.Parallel(_HALF, _HALF):
                quarters[0, i, j] = T.if_then_else(i // _BLOCK == j // _BLOCK,
                                                   diag_inverse[i // _BLOCK, i % _BLOCK, j % _BLOCK], 0.0)
                quarters[1, i, j] = T.if_then_else(i // _BLOCK == j // _BLOCK,
                                                   diag_inverse[2 + i // _BLOCK, i % _BLOCK, j % _BLOCK], 0.0)
            T.clear(sums)
            for r in T.unroll(_BLOCK):
                left = diag_inverse[2 * block + 1, row, r]
                for c in T.vectorized(4):
                    sums[c] = sums[c] - left * merge[block, r, cols + c]
            for c in T.vectorized(4):
                quarters[block, _BLOCK + row, cols + c] = sums[c]

            # 4. A~[32:, :32] = A~_B (-L_BA) A~_A.
            T.gemm(cross_lower, quarters[0, :, :], corner, clear_accum=True)
            T.copy(corner, quarters[2, :, :])
            T.gemm(quarters[1, :, :], quarters[2, :, :], corner, clear_accum=True)

            for i, j in T.Parallel(_HALF, _HALF):
                out_shared[_HALF + i, j] = T.cast(corner[i, j], dtype)
            for i, j in T.Parallel(_HALF, _HALF):
                out_shared[i, j] = T.cast(quarters[0, i, j], dtype)
                out_shared[i, _HALF + j] = T.cast(0, dtype)
                out_shared[_HALF + i, _HALF + j] = T.cast(quarters[1, i, j], dtype)
            for i, j in T.Parallel(_C, _C):
                if i < length:
                    inverse[start + i, head, j] = out_shared[i, j]
            for t in T.Parallel(_C):
                if t < length:
                    gamma[start + t, head] = gamma_shared[t]

    if not normalize_qk:
        @T.prim_func
        def chunk_inverse_kernel(
            k: T.Tensor(qk_shape, dtype),
            g: T.Tensor((num_tokens, num_v_heads), g_dtype),
            beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
            chunk_bounds: T.Tensor((num_chunks, 2), "int32"),
            gamma: T.Tensor((num_tokens, num_v_heads), "float32"),
            inverse: T.Tensor((num_tokens, num_v_heads, _C), dtype),
        ):
            body(k, g, beta, chunk_bounds, gamma, inverse, None)

        return chunk_inverse_kernel

    @T.prim_func
    def normalizing_inverse_kernel(
        q: T.Tensor(qk_shape, dtype),
        k: T.Tensor(qk_shape, dtype),
        g: T.Tensor((num_tokens, num_v_heads), g_dtype),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),
        q_rstd: T.Tensor((num_tokens, num_qk_heads), "float32"),
        k_rstd: T.Tensor((num_tokens, num_qk_heads), "float32"),
        gamma: T.Tensor((num_tokens, num_v_heads), "float32"),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), dtype),
    ):
        body(k, g, beta, chunk_bounds, gamma, inverse,
             SimpleNamespace(q=q, q_rstd=q_rstd, k_rstd=k_rstd))

    return normalizing_inverse_kernel


@functools.lru_cache(maxsize=None)
def compile_inverse(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32",
                    g_dtype: str = "float32", min_blocks_per_sm: int = MIN_BLOCKS_PER_SM, normalize_qk: bool = False):
    program = inverse_program(head_dim, dtype, beta_dtype, g_dtype, min_blocks_per_sm, normalize_qk)
    return compile_for_hopper(program, fast_math=True)


def gamma_and_inverse(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_bounds: torch.Tensor,
                      normalize_q: torch.Tensor | None = None):
    """(gamma, A~) of every chunk and value head: gamma float32 [T, Hv], A~ [T, Hv, 64] in k's dtype,
    for k [T, Hqk, K], g and beta [T, Hv] (float32, bf16 or fp16) and chunk_bounds, int32 [num_chunks, 2]
    (chunk_plan.chunk_bounds, ForwardPlan.chunk_bounds).

    normalize_q: q [T, Hqk, K], given for the L2 norm of q and k (use_qk_l2norm_in_kernel): A~ is then that
    of k^ (k normalised in the kernel) and a third value (q_rstd, k_rstd), float32 [T, Hqk] each, the norm's
    r = (sum(x^2) + eps)^-1/2 of every row, bitwise what l2norm.l2norm_forward gives."""
    num_tokens, num_qk_heads, head_dim = k.shape
    num_v_heads = beta.shape[1]
    gamma = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=k.device)
    inverse = torch.empty(num_tokens, num_v_heads, _C, dtype=k.dtype, device=k.device)
    kernel = None
    if chunk_bounds.shape[0] > 0:
        kernel = compile_inverse(head_dim, dtype_name(k), dtype_name(beta), dtype_name(g),
                                 normalize_qk=normalize_q is not None)
    if normalize_q is None:
        if kernel is not None:
            kernel(k, g, beta, chunk_bounds, gamma, inverse)
        return gamma, inverse
    rstds = torch.empty(2, num_tokens, num_qk_heads, dtype=torch.float32, device=k.device)
    if kernel is not None:
        kernel(normalize_q, k, g, beta, chunk_bounds, rstds[0], rstds[1], gamma, inverse)
    return gamma, inverse, (rstds[0], rstds[1])
