"""Gate-free inverse per 64-token chunk: A~ = (I + StrictLower(diag(beta) K K^T))^-1 (docs/gdn-math.md §2.3, §2.5).

Stored in bf16 as [B, T, Hv, 64] (row t of its chunk's matrix), the backward's operand when the
forward kept none; bf16 rounding of A~ stays well inside the error budget. The solve itself
(`make_inverse_into`) is a macro of its own: the kernel here is the per-value-head one, for groups of
more than 8 value heads (grouped_inverse.py serves the rest).
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import chunk_indices, flat_cu_seqlens
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, compile_for_hopper, dtype_name

_THREADS = 128
_C = CHUNK_SIZE


def make_inverse_into(head_dim: int, dtype: str):
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


def inverse_program(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    """One CTA per (chunk, value head).

    16x16 diagonal blocks by forward substitution, then the two block merges
    (X21 = -X22 L21 X11); the 32x32 merge runs on tensor cores (tf32).
    """
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    inverse_into = make_inverse_into(head_dim, dtype)

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


@functools.lru_cache(maxsize=None)
def compile_inverse(head_dim: int = HEAD_DIM, dtype: str = "bfloat16", beta_dtype: str = "float32"):
    return compile_for_hopper(inverse_program(head_dim, dtype, beta_dtype))


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
        kernel = compile_inverse(head_dim, dtype_name(k), dtype_name(beta))
        kernel(k.reshape(num_tokens, num_qk_heads, head_dim).contiguous(),
               beta.reshape(num_tokens, num_v_heads).contiguous(), cu_seqlens, chunk_index, result)
    return result.view(batch_size, seq_len, num_v_heads, _C)
