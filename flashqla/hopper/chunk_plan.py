"""Planning helpers for the Hopper kernels: which chunk each CTA walks, V-split choice, pieces."""

import torch

CHUNK_SIZE = 64
# An H100/H200 has 132 SMs; the kernels ask the device when one is present.
DEFAULT_SM_COUNT = 132


def flat_cu_seqlens(batch_size: int, seq_len: int, device) -> torch.Tensor:
    """cu_seqlens for a dense [B, T] batch seen as B packed sequences of length T."""
    return torch.arange(0, batch_size + 1, device=device, dtype=torch.int32) * seq_len


def chunk_counts(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Number of chunks of every sequence (a partial last chunk counts; an empty sequence has 0)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return (lengths + chunk_size - 1) // chunk_size


def chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [N+1]: global index of each sequence's first chunk; the last entry is the total."""
    counts = chunk_counts(cu_seqlens, chunk_size)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=cu_seqlens.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets


def chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [num_chunks, 2]: (sequence, chunk within the sequence) for every chunk of the batch.

    Empty sequences contribute no rows, so per-chunk kernels never see them.
    """
    counts = chunk_counts(cu_seqlens, chunk_size).long()
    num_sequences = counts.numel()
    sequence = torch.repeat_interleave(torch.arange(num_sequences, device=cu_seqlens.device), counts)
    first = torch.cumsum(counts, 0) - counts
    within = torch.arange(sequence.numel(), device=cu_seqlens.device) - first[sequence]
    return torch.stack([sequence, within], dim=1).to(torch.int32).contiguous()


def value_block_size(num_sequences: int, num_heads: int, value_dim: int = 128,
                     sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Width of the V slice one CTA owns: split V when (sequences x heads) cannot fill the SMs."""
    work = num_sequences * num_heads
    if work >= sm_count * 0.7 or value_dim <= 32:
        return value_dim
    if work * 2 >= sm_count * 0.7 or value_dim <= 64:
        return min(64, value_dim)
    return 32


def device_sm_count(device) -> int:
    if torch.device(device).type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count
