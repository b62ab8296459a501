"""Chunk-local cumulative sum of the log decay g (gamma of docs/gdn-math.md §2.1)."""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import chunk_indices, flat_cu_seqlens
from flashqla.hopper.common import CHUNK_SIZE, compile_for_hopper, dtype_name

_THREADS = 128


def cumsum_program(g_dtype: str = "float32", chunk_size: int = CHUNK_SIZE):
    """One CTA per chunk; one thread per head walks the chunk's tokens in order."""
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_heads = T.dynamic("num_heads")

    @T.prim_func
    def chunk_local_cumsum_kernel(
        g: T.Tensor((num_tokens, num_heads), g_dtype),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_index: T.Tensor((num_chunks, 2), "int32"),
        gamma: T.Tensor((num_tokens, num_heads), "float32"),
    ):
        with T.Kernel(num_chunks, threads=_THREADS) as chunk:
            tx = T.get_thread_binding()
            sequence = chunk_index[chunk, 0]
            start = cu_seqlens[sequence] + chunk_index[chunk, 1] * chunk_size
            length = T.min(cu_seqlens[sequence + 1] - start, chunk_size)
            running = T.alloc_var("float32")
            for head_round in T.serial(T.ceildiv(num_heads, _THREADS)):
                head = head_round * _THREADS + tx
                if head < num_heads:
                    running = 0.0
                    for t in T.serial(length):
                        running = running + T.cast(g[start + t, head], "float32")
                        gamma[start + t, head] = running

    return chunk_local_cumsum_kernel


@functools.lru_cache(maxsize=None)
def compile_cumsum(g_dtype: str = "float32", chunk_size: int = CHUNK_SIZE):
    return compile_for_hopper(cumsum_program(g_dtype, chunk_size))


def chunk_local_cumsum(g: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                       chunk_size: int = CHUNK_SIZE, chunk_index: torch.Tensor | None = None) -> torch.Tensor:
    """float32 gamma with g's shape [B, T, H]: running sum of g from each chunk's start.

    With cu_seqlens (B == 1) chunks restart at every sequence start.
    """
    batch_size, seq_len, num_heads = g.shape
    if cu_seqlens is None:
        cu_seqlens = flat_cu_seqlens(batch_size, seq_len, g.device)
    cu_seqlens = cu_seqlens.to(torch.int32)
    if chunk_index is None:
        chunk_index = chunk_indices(cu_seqlens, chunk_size)
    g_flat = g.reshape(batch_size * seq_len, num_heads).contiguous()
    gamma = torch.empty(g_flat.shape, dtype=torch.float32, device=g.device)
    if chunk_index.shape[0] > 0:
        kernel = compile_cumsum(dtype_name(g), chunk_size)
        kernel(g_flat, cu_seqlens, chunk_index, gamma)
    return gamma.view(batch_size, seq_len, num_heads)
