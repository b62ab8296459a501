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
                     sm_count: int = DEFAULT_SM_COUNT, max_block: int = 128) -> int:
    """Width of the V slice one CTA owns: split V when (sequences x heads) cannot fill the SMs."""
    work = num_sequences * num_heads
    block = min(value_dim, max_block)
    while block > 32 and work * (value_dim // block) < sm_count * 0.7:
        block //= 2
    return block


def device_sm_count(device) -> int:
    if torch.device(device).type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_pieces(cu_seqlens: torch.Tensor, num_heads: int, value_blocks: int, sm_count: int = DEFAULT_SM_COUNT,
                min_piece_chunks: int = 16, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [P, 4] rows (sequence, first token, end token, ends_sequence) on cu_seqlens' device.

    Intra-card context parallelism: when (sequences x heads x V blocks) CTAs cannot fill the SMs,
    long sequences are cut at chunk boundaries into pieces, so that about `sm_count` CTAs run, each
    piece at least `min_piece_chunks` long. Every sequence, empty ones too, ends in exactly one piece.
    """
    bounds = cu_seqlens.tolist()
    lengths = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
    chunks = [(n + chunk_size - 1) // chunk_size for n in lengths]
    busy = sum(1 for c in chunks if c > 0)
    ctas_per_piece = num_heads * value_blocks
    target_pieces = sm_count // max(ctas_per_piece, 1)
    rows = []
    if busy >= target_pieces or sum(chunks) == 0:
        rows = [(i, bounds[i], bounds[i + 1], 1) for i in range(len(lengths))]
    else:
        piece_chunks = max(min_piece_chunks, -(-sum(chunks) // target_pieces))
        for i, n_chunks in enumerate(chunks):
            n_pieces = max(1, -(-n_chunks // piece_chunks))
            per_piece = -(-n_chunks // n_pieces)
            for p in range(n_pieces):
                start = bounds[i] + p * per_piece * chunk_size
                end = min(bounds[i] + (p + 1) * per_piece * chunk_size, bounds[i + 1])
                if start < end or p == 0:
                    rows.append((i, start, end, 0))
            seq, start, end, _ = rows[-1]
            rows[-1] = (seq, start, end, 1)
    return torch.tensor(rows, dtype=torch.int32).to(cu_seqlens.device)


def walk_starts(pieces: torch.Tensor, cu_seqlens: torch.Tensor, gamma: torch.Tensor,
                log_decay_threshold: float = -10.0, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [P, H]: the token where each (piece, head) CTA starts walking (on the GPU, no sync).

    A piece that does not start its sequence needs the state entering it. Walking from zero over
    the n chunks before it rebuilds that state up to a relative error of exp(decay over those n
    chunks): take the fewest chunks whose summed decay is <= log_decay_threshold, else the whole
    prefix from the sequence start (exact, with h0). -inf always walks from the sequence start.

    gamma: [T, H] fp32 chunk-local cumsum of g.
    """
    num_pieces = pieces.shape[0]
    num_heads = gamma.shape[1]
    sequence = pieces[:, 0].long()
    piece_start = pieces[:, 1].long()
    seq_start = cu_seqlens.long()[sequence]
    if num_pieces == cu_seqlens.numel() - 1 or log_decay_threshold == float("-inf"):
        return seq_start.to(torch.int32)[:, None].expand(num_pieces, num_heads).contiguous()
    # Per piece: cumulative decay of the k chunks right before piece_start, k = 1..max.
    max_back = int(((piece_start - seq_start) // chunk_size).max().item())
    if max_back == 0:
        return seq_start.to(torch.int32)[:, None].expand(num_pieces, num_heads).contiguous()
    back = torch.arange(1, max_back + 1, device=gamma.device)
    last_token = piece_start[:, None] - (back[None, :] - 1) * chunk_size - 1          # [P, max_back]
    valid = last_token >= seq_start[:, None]
    decay = gamma.double()[last_token.clamp(min=0)]                                   # [P, max_back, H]
    decay = torch.where(valid[..., None], decay, torch.zeros_like(decay))
    summed = decay.cumsum(dim=1)
    enough = summed <= log_decay_threshold
    # Fewest chunks that decay enough; none -> walk from the sequence start.
    first_enough = torch.where(enough.any(dim=1), enough.float().argmax(dim=1) + 1,
                               torch.full_like(enough[:, 0, :], max_back + 1, dtype=torch.long))
    walk = piece_start[:, None] - first_enough * chunk_size
    walk = torch.maximum(walk, seq_start[:, None])
    return walk.to(torch.int32).contiguous()
