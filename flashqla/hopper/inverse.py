"""Gate-free inverse per 64-token chunk: A~ = (I + StrictLower(diag(beta) K K^T))^-1 (gdn-kernels.md section 2).

Stored in bf16 as [B, T, Hv, 64] (row t of its chunk's matrix): the fused forward reads it
straight into a tensor-core operand, and bf16 rounding of A~ stays well inside the error budget.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import CHUNK_SIZE, chunk_indices, flat_cu_seqlens
from flashqla.hopper.cumsum import HOPPER_TARGET
from flashqla.hopper.grouped_products import MAX_GROUP_SIZE, MIN_BLOCKS_PER_SM, compile_grouped_products

_THREADS = 128
_LOG2E = 1.4426950408889634
_C = CHUNK_SIZE


def _make_inverse_into(head_dim: int, dtype: str):
    """Macro: x (fp32 shared, 64x64) <- the gate-free inverse of the chunk at `start`."""

    @T.macro
    def inverse_into(k, beta, k_shared, beta_shared, x, start, length, head, qk_head):
        gram = T.alloc_fragment((_C, _C), "float32")
        # neg_lower = -StrictLower(diag(beta) K K^T)
        neg_lower = T.alloc_shared((_C, _C), "float32")
        diag_row = T.alloc_shared((4, 16), "float32")
        merge16 = T.alloc_shared((2, 16, 16), "float32")
        x11 = T.alloc_shared((32, 32), "float32")
        x22 = T.alloc_shared((32, 32), "float32")
        l21 = T.alloc_shared((32, 32), "float32")
        t32 = T.alloc_shared((32, 32), "float32")
        prod32 = T.alloc_fragment((32, 32), "float32")

        for t, d in T.Parallel(_C, head_dim):
            k_shared[t, d] = T.if_then_else(t < length, k[start + t, qk_head, d], T.cast(0, dtype))
        for t in T.Parallel(_C):
            beta_shared[t] = T.if_then_else(t < length, T.cast(beta[start + t, head], "float32"), 0.0)
        T.gemm(k_shared, k_shared, gram, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(_C, _C):
            neg_lower[i, j] = T.if_then_else(j < i, -beta_shared[i] * gram[i, j], 0.0)
            x[i, j] = T.if_then_else(i == j, 1.0, 0.0)

        # Level 1: rows of each 16x16 diagonal block, one row at a time (four blocks at once).
        for i in T.unroll(1, 16):
            for b, c in T.Parallel(4, 16):
                acc = T.alloc_var("float32")
                acc = 0.0
                for j in T.unroll(i):
                    acc = acc + neg_lower[b * 16 + i, b * 16 + j] * x[b * 16 + j, b * 16 + c]
                diag_row[b, c] = acc
            for b, c in T.Parallel(4, 16):
                if c < i:
                    x[b * 16 + i, b * 16 + c] = diag_row[b, c]

        # Level 2: the off-diagonal 16x16 block of each 32x32 diagonal block.
        for p, i, j in T.Parallel(2, 16, 16):
            acc2 = T.alloc_var("float32")
            acc2 = 0.0
            for r in T.unroll(16):
                acc2 = acc2 + neg_lower[p * 32 + 16 + i, p * 32 + r] * x[p * 32 + r, p * 32 + j]
            merge16[p, i, j] = acc2
        for p, i, j in T.Parallel(2, 16, 16):
            acc3 = T.alloc_var("float32")
            acc3 = 0.0
            for r in T.unroll(16):
                acc3 = acc3 + x[p * 32 + 16 + i, p * 32 + 16 + r] * merge16[p, r, j]
            x[p * 32 + 16 + i, p * 32 + j] = acc3

        # Level 3: X[32:, :32] = X22 (-L21) X11 on tensor cores.
        for i, j in T.Parallel(32, 32):
            x11[i, j] = x[i, j]
            x22[i, j] = x[32 + i, 32 + j]
            l21[i, j] = neg_lower[32 + i, j]
        T.gemm(l21, x11, prod32, clear_accum=True)
        T.copy(prod32, t32)
        T.gemm(x22, t32, prod32, clear_accum=True)
        for i, j in T.Parallel(32, 32):
            x[32 + i, j] = prod32[i, j]

    return inverse_into


def inverse_program(head_dim: int = 128, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    """One CTA per (chunk, value head).

    16x16 diagonal blocks by forward substitution, then the two block merges
    (X21 = -X22 L21 X11); the 32x32 merge runs on tensor cores (tf32).
    """
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    inverse_into = _make_inverse_into(head_dim, dtype)

    @T.prim_func
    def gate_free_inverse_kernel(
        k: T.Tensor((num_tokens, num_qk_heads, head_dim), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_index: T.Tensor((num_chunks, 2), "int32"),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), "bfloat16"),
    ):
        with T.Kernel(num_chunks * num_v_heads, threads=_THREADS) as block:
            chunk = block // num_v_heads
            head = block % num_v_heads
            qk_head = head // (num_v_heads // num_qk_heads)
            sequence = chunk_index[chunk, 0]
            start = cu_seqlens[sequence] + chunk_index[chunk, 1] * _C
            length = T.min(cu_seqlens[sequence + 1] - start, _C)
            k_shared = T.alloc_shared((_C, head_dim), dtype)
            beta_shared = T.alloc_shared((_C,), "float32")
            x = T.alloc_shared((_C, _C), "float32")
            out_shared = T.alloc_shared((_C, _C), "bfloat16")
            inverse_into(k, beta, k_shared, beta_shared, x, start, length, head, qk_head)
            for i, j in T.Parallel(_C, _C):
                out_shared[i, j] = T.cast(x[i, j], "bfloat16")
            for i, j in T.Parallel(_C, _C):
                if i < length:
                    inverse[start + i, head, j] = out_shared[i, j]

    return gate_free_inverse_kernel


def gated_products_program(head_dim: int = 128, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    """The S-independent 64x64 matrices of each chunk, for the fused forward (bf16, [T, Hv, 64]):

        gated_inverse = Gm * A~ * beta_col  (Ab of gdn-kernels.md section 2)
        scores        = scale * Gm * tril(Q K^T)

    Built here, parallel over every chunk, they leave the fused kernel's sequential walk.
    """
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    inverse_into = _make_inverse_into(head_dim, dtype)

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
                gamma_shared[t] = T.if_then_else(t < length, gamma[start + t, head], 0.0) * _LOG2E
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
def compile_inverse(head_dim: int = 128, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    program = inverse_program(head_dim, dtype, beta_dtype)
    return tilelang.compile(program, target=HOPPER_TARGET)


def gate_free_inverse(k: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      chunk_index: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [B, T, Hv, 64]: row t of the gate-free inverse of t's chunk (chunks restart per sequence)."""
    batch_size, seq_len, num_qk_heads, head_dim = k.shape
    num_v_heads = beta.shape[-1]
    if cu_seqlens is None:
        cu_seqlens = flat_cu_seqlens(batch_size, seq_len, k.device)
    cu_seqlens = cu_seqlens.to(torch.int32)
    if chunk_index is None:
        chunk_index = chunk_indices(cu_seqlens)
    num_tokens = batch_size * seq_len
    result = torch.empty(num_tokens, num_v_heads, _C, dtype=torch.bfloat16, device=k.device)
    if chunk_index.shape[0] > 0:
        kernel = compile_inverse(head_dim, str(k.dtype).removeprefix("torch."), str(beta.dtype).removeprefix("torch."))
        kernel(k.reshape(num_tokens, num_qk_heads, head_dim).contiguous(),
               beta.reshape(num_tokens, num_v_heads).contiguous(), cu_seqlens, chunk_index, result)
    return result.view(batch_size, seq_len, num_v_heads, _C)


@functools.lru_cache(maxsize=None)
def compile_gated_products(head_dim: int = 128, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    program = gated_products_program(head_dim, dtype, beta_dtype)
    return tilelang.compile(program, target=HOPPER_TARGET, pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})


def gated_products(q: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, scale: float,
                   cu_seqlens: torch.Tensor, chunk_index: torch.Tensor, grouped: bool | None = None,
                   min_blocks_per_sm: int = MIN_BLOCKS_PER_SM, with_inverse: bool = False):
    """(gated_inverse, scores, inverse), each [T, Hv, 64] in q's dtype, on flattened inputs:
    q, k [T, Hqk, K]; gamma (fp32 chunk-local cumsum), beta [T, Hv]; cu_seqlens int32 [N+1].

    grouped=True runs grouped_products.py (one CTA per chunk and qk head, its value heads sharing
    the Q K^T and K K^T products; Hv / Hqk <= 8; min_blocks_per_sm is its register cap), 1.3-1.4x
    faster on the H200; None picks it wherever the group fits, else the per-value-head kernel here.
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
        dtypes = (str(q.dtype).removeprefix("torch."), str(beta.dtype).removeprefix("torch."))
        if grouped:
            kernel = compile_grouped_products(q.shape[-1], *dtypes, min_blocks_per_sm, write_inverse)
            kernel(q, k, gamma, beta, cu_seqlens, chunk_index, gated_inverse, scores, inverse, float(scale))
        else:
            kernel = compile_gated_products(q.shape[-1], *dtypes)
            kernel(q, k, gamma, beta, cu_seqlens, chunk_index, gated_inverse, scores, float(scale))
    return gated_inverse, scores, (inverse if write_inverse else None)
