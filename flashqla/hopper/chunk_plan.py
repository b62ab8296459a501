"""Planning helpers for the Hopper kernels: which chunk each CTA walks, V-split choice, pieces."""

import functools
import heapq
from dataclasses import dataclass

import numpy as np
import torch

from flashqla.hopper.common import CHUNK_SIZE, DEFAULT_LOG_DECAY_THRESHOLD, HEAD_DIM
# pieces[p] = (sequence, first token, end token, 1 if the piece ends its sequence)
PIECE_FIELDS = 4
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


def chunk_bounds(cu_seqlens: torch.Tensor, chunk_index: torch.Tensor | None = None,
                 chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [num_chunks, 2]: (first token, number of tokens) of every chunk of chunk_index (default:
    chunk_indices(cu_seqlens)), so that a kernel finds a chunk's rows with one load instead of two dependent ones."""
    if chunk_index is None:
        chunk_index = chunk_indices(cu_seqlens, chunk_size)
    sequence = chunk_index[:, 0].long()
    start = cu_seqlens[sequence] + chunk_index[:, 1] * chunk_size
    length = torch.clamp(cu_seqlens[sequence + 1] - start, max=chunk_size)
    return torch.stack([start, length], dim=1).to(torch.int32).contiguous()


def value_block_size(num_sequences: int, num_heads: int, value_dim: int = HEAD_DIM,
                     sm_count: int = DEFAULT_SM_COUNT, max_block: int = HEAD_DIM) -> int:
    """Width of the V slice one CTA owns: split V when (sequences x heads) cannot fill the SMs."""
    work = num_sequences * num_heads
    block = min(value_dim, max_block)
    while block > 32 and work * (value_dim // block) < sm_count * 0.7:
        block //= 2
    return block


def device_sm_count(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Chunks a split piece's CTA is expected to walk before its own (the decay-truncated warm-up; about
# 4 for Qwen-like decays). Only used to compare piece plans.
PLANNED_WARMUP_CHUNKS = 4


def _split_rows(bounds: list[int], chunks: list[int], piece_chunks: int | None,
                chunk_size: int, ragged: bool = False) -> list[tuple[int, int, int, int]]:
    """Every sequence cut into near-equal pieces of at most piece_chunks chunks (None: not cut), or with
    ragged into pieces of exactly piece_chunks chunks and a shorter last one."""
    rows = []
    for i, n_chunks in enumerate(chunks):
        n_pieces = 1 if piece_chunks is None else max(1, -(-n_chunks // piece_chunks))
        per_piece = piece_chunks if ragged else -(-n_chunks // n_pieces)
        for p in range(n_pieces):
            start = bounds[i] + p * per_piece * chunk_size
            end = min(bounds[i] + (p + 1) * per_piece * chunk_size, bounds[i + 1])
            if start < end or p == 0:
                rows.append((i, start, end, 0))
        seq, start, end, _ = rows[-1]
        rows[-1] = (seq, start, end, 1)
    return rows


def _walk_makespan(rows, bounds: list[int], ctas_per_piece: int, sm_count: int, chunk_size: int) -> int:
    """Chunk steps until the last CTA of a fused walk over these pieces ends: one CTA per SM at a
    time, started in grid order (piece-major) on whichever SM frees first."""
    free_at = [0] * sm_count
    for seq, start, end, _ in rows:
        steps = -(-(end - start) // chunk_size) + (PLANNED_WARMUP_CHUNKS if start > bounds[seq] else 0)
        for _ in range(ctas_per_piece):
            heapq.heapreplace(free_at, free_at[0] + steps)
    return max(free_at)


def _piece_rows(bounds: list[int], chunks: list[int], ctas_per_piece: int, sm_count: int,
                min_piece_chunks: int, chunk_size: int, ragged_cuts: bool = False) -> list[tuple[int, int, int, int]]:
    """The piece plan with the shortest simulated walk among: no cut, cuts into near-equal pieces of
    ceil(total / k) chunks (at least min_piece_chunks), and with ragged_cuts (a candidate: bench --compare
    piece_plans) cuts every S chunks with a shorter last piece for S = ceil(total x CTAs a piece / (w x SMs)),
    w = 1..4: w waves of full pieces, the short ones filling the last. More CTAs than SMs can win: with 28672
    + 4096 tokens and 48 CTAs a piece (8/24 heads), one piece per sequence walks 448 chunks on 96 SMs; eight
    pieces of at most 64 chunks give 384 CTAs that take turns on the SMs, about 204 chunk steps in all. At
    16/48 heads x 32768 tokens six pieces of 94, 94, 94, 94, 94 and 42 chunks walk 196 chunk steps where five
    equal ones walk 214. The simulation assumes every head's warm-up
    is short: a head that never decays walks from its sequence start (exact) and can be the longest CTA."""
    unsplit = _split_rows(bounds, chunks, None, chunk_size)
    total = sum(chunks)
    busy = sum(1 for c in chunks if c > 0)  # empty sequences' CTAs exit at once
    if total == 0 or busy * ctas_per_piece >= 4 * sm_count:
        return unsplit  # empty, or enough CTAs to fill the SMs several times over
    best, best_steps = unsplit, _walk_makespan(unsplit, bounds, ctas_per_piece, sm_count, chunk_size)
    lengths = {max(min_piece_chunks, -(-total // k)) for k in range(1, 4 * sm_count // ctas_per_piece + 2)}
    candidates = [(length, False) for length in sorted(lengths, reverse=True)]
    if ragged_cuts:
        ragged = {max(min_piece_chunks, -(-total * ctas_per_piece // (waves * sm_count))) for waves in range(1, 5)}
        candidates += [(length, True) for length in sorted(ragged, reverse=True)]
    for length, cut_ragged in candidates:
        if length >= max(chunks):
            continue
        rows = _split_rows(bounds, chunks, length, chunk_size, ragged=cut_ragged)
        steps = _walk_makespan(rows, bounds, ctas_per_piece, sm_count, chunk_size)
        if steps < 0.95 * best_steps:  # a plan with more pieces must win clearly (the model is rough)
            best, best_steps = rows, steps
    return best


def plan_pieces(cu_seqlens: torch.Tensor, num_heads: int, value_blocks: int, sm_count: int = DEFAULT_SM_COUNT,
                min_piece_chunks: int = 16, chunk_size: int = CHUNK_SIZE,
                host_bounds: list[int] | None = None, ragged_cuts: bool = False) -> torch.Tensor:
    """int32 [P, 4] rows (sequence, first token, end token, ends_sequence) on cu_seqlens' device.
    host_bounds: cu_seqlens as a list when the caller holds it (no device->host read).

    Intra-card context parallelism: long sequences are cut at chunk boundaries into pieces when a
    simulated walk says the cut ends sooner (_piece_rows); pieces are cut from a length of at least
    `min_piece_chunks`, shared evenly, so a piece can be a little shorter. Every sequence, empty
    ones too, ends in exactly one piece.
    """
    bounds = cu_seqlens.tolist() if host_bounds is None else host_bounds
    chunks = [(bounds[i + 1] - bounds[i] + chunk_size - 1) // chunk_size for i in range(len(bounds) - 1)]
    rows = _piece_rows(bounds, chunks, num_heads * value_blocks, sm_count, min_piece_chunks, chunk_size, ragged_cuts)
    return torch.tensor(rows, dtype=torch.int32).to(cu_seqlens.device)


@dataclass
class ForwardPlan:
    """Everything the forward kernels index by, built on the host from one read of cu_seqlens.

    Cached plans are shared between calls: nothing may write into these tensors."""

    chunk_index: torch.Tensor      # int32 [num_chunks, 2]: (sequence, chunk within it)
    chunk_bounds: torch.Tensor     # int32 [num_chunks, 2]: (first token, number of tokens), see chunk_bounds
    chunk_offsets: torch.Tensor    # int32 [N + 1]: first global chunk of each sequence
    pieces: torch.Tensor           # int32 [P, 4]: see plan_pieces
    value_block: int               # V columns per CTA
    max_walk_back: int             # most chunks a piece can walk back before its start (0: none split)


# Every GDN layer of a training step sees the same cu_seqlens: plan once, reuse for the others.
FORWARD_PLAN_CACHE_SIZE = 16


def plan_forward(cu_seqlens: torch.Tensor, num_heads: int, head_dim: int = HEAD_DIM, sm_count: int = DEFAULT_SM_COUNT,
                 max_value_block: int = HEAD_DIM, min_piece_chunks: int = 16, chunk_size: int = CHUNK_SIZE,
                 host_bounds: list[int] | None = None, ragged_cuts: bool = False) -> ForwardPlan:
    """Chunks, pieces and V split for one forward, from a small LRU cache keyed by the bounds and
    every other argument (and cu_seqlens' device). One device->host read of cu_seqlens unless the
    caller already holds it (host_bounds, the same values as a list); a cache miss adds one
    host->device copy (two when a sequence is split). ragged_cuts: _piece_rows' candidate."""
    bounds = tuple(cu_seqlens.tolist() if host_bounds is None else host_bounds)
    return _cached_forward_plan(bounds, cu_seqlens.device, num_heads, head_dim, sm_count, max_value_block,
                                min_piece_chunks, chunk_size, ragged_cuts)


@functools.lru_cache(maxsize=FORWARD_PLAN_CACHE_SIZE)
def _cached_forward_plan(bounds: tuple[int, ...], device: torch.device, num_heads: int, head_dim: int,
                         sm_count: int, max_value_block: int, min_piece_chunks: int, chunk_size: int,
                         ragged_cuts: bool) -> ForwardPlan:
    return build_forward_plan(list(bounds), device, num_heads, head_dim, sm_count, max_value_block,
                              min_piece_chunks, chunk_size, ragged_cuts)


def build_forward_plan(bounds: list[int], device: torch.device, num_heads: int, head_dim: int = HEAD_DIM,
                       sm_count: int = DEFAULT_SM_COUNT, max_value_block: int = HEAD_DIM, min_piece_chunks: int = 16,
                       chunk_size: int = CHUNK_SIZE, ragged_cuts: bool = False) -> ForwardPlan:
    """plan_forward without the cache: bounds is cu_seqlens as a list, device where the plan goes."""
    bounds = np.asarray(bounds, dtype=np.int64)
    lengths = bounds[1:] - bounds[:-1]
    chunks = (lengths + chunk_size - 1) // chunk_size
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(chunks)
    sequence = np.repeat(np.arange(len(chunks)), chunks)
    within = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], chunks)

    value_block = min(max_value_block, head_dim)
    bounds_list, chunks_list = bounds.tolist(), chunks.tolist()
    rows = _piece_rows(bounds_list, chunks_list, num_heads * (head_dim // value_block), sm_count,
                       min_piece_chunks, chunk_size, ragged_cuts)
    if len(rows) * num_heads * (head_dim // value_block) < sm_count // 2:
        # Sequences too short to split further: split V instead.
        value_block = value_block_size(len(rows), num_heads, head_dim, sm_count, max_value_block)
        rows = _piece_rows(bounds_list, chunks_list, num_heads * (head_dim // value_block), sm_count,
                           min_piece_chunks, chunk_size, ragged_cuts)
    pieces = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    max_walk_back = int(((pieces[:, 1] - bounds[pieces[:, 0]]) // chunk_size).max()) if len(rows) else 0

    index = np.stack([sequence, within], 1)
    bounds_of_chunks = chunk_bounds(torch.from_numpy(bounds), torch.from_numpy(index), chunk_size).numpy()
    packed = np.concatenate([index.reshape(-1), bounds_of_chunks.reshape(-1), offsets, pieces.reshape(-1)])
    packed = torch.from_numpy(packed.astype(np.int32)).to(device)
    n_index, n_offsets = 2 * len(sequence), len(offsets)
    return ForwardPlan(
        chunk_index=packed[:n_index].view(-1, 2),
        chunk_bounds=packed[n_index:2 * n_index].view(-1, 2),
        chunk_offsets=packed[2 * n_index:2 * n_index + n_offsets],
        pieces=packed[2 * n_index + n_offsets:].view(-1, 4),
        value_block=value_block,
        max_walk_back=max_walk_back,
    )


def walk_starts(pieces: torch.Tensor, cu_seqlens: torch.Tensor, gamma: torch.Tensor,
                log_decay_threshold: float = DEFAULT_LOG_DECAY_THRESHOLD, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [P, H]: the token where each (piece, head) CTA of the forward's walk starts. The torch
    definition of walk_bounds.walk_bounds(ahead=False), which the GPU runs; this one runs anywhere
    (the kernel's tests compare the two bitwise) and reads one number back from the device.

    A piece that does not start its sequence needs the state entering it. Walking from zero over
    the n chunks before it rebuilds that state up to a relative error of exp(decay over those n
    chunks): take the fewest chunks whose summed decay is <= log_decay_threshold, else the whole
    prefix from the sequence start (exact, with h0). -inf always walks from the sequence start.
    gamma: [T, H] fp32 chunk-local cumsum of g; pieces: ForwardPlan.pieces.
    """
    num_pieces, num_heads = pieces.shape[0], gamma.shape[1]
    piece_start = pieces[:, 1].long()
    seq_start = cu_seqlens.long()[pieces[:, 0].long()]
    max_back = int(((piece_start - seq_start) // chunk_size).max()) if num_pieces else 0
    if max_back == 0 or log_decay_threshold == float("-inf"):
        return seq_start.to(torch.int32)[:, None].expand(num_pieces, num_heads).contiguous()
    last_token = piece_start[:, None] - torch.arange(max_back, device=gamma.device)[None, :] * chunk_size - 1
    outside = (last_token < seq_start[:, None])[..., None]
    # The walk takes one chunk more than those still short of the threshold (or reaches the sequence start).
    short = _chunks_short_of_threshold(gamma, last_token.clamp(min=0), outside, log_decay_threshold)
    return torch.maximum(piece_start[:, None] - (short + 1) * chunk_size, seq_start[:, None]).to(torch.int32)


def walk_ends(pieces: torch.Tensor, cu_seqlens: torch.Tensor, gamma: torch.Tensor,
              log_decay_threshold: float = DEFAULT_LOG_DECAY_THRESHOLD, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int32 [P, H]: the token where each (piece, head) CTA of the backward's reverse walk
    starts walking back from; the torch definition of walk_bounds.walk_bounds(ahead=True). The
    mirror of walk_starts: the gradient leaving a piece is rebuilt from zero over the n chunks after
    it, n the fewest whose summed decay is <= log_decay_threshold, else from the sequence end
    (exact, with dht); -inf always walks from the sequence end."""
    num_pieces, num_heads = pieces.shape[0], gamma.shape[1]
    piece_end = pieces[:, 2].long()
    seq_end = cu_seqlens.long()[pieces[:, 0].long() + 1]
    if num_pieces == 0 or log_decay_threshold == float("-inf"):
        return seq_end.to(torch.int32)[:, None].expand(num_pieces, num_heads).contiguous()
    max_ahead = max(int(((seq_end - piece_end + chunk_size - 1) // chunk_size).max()), 1)
    chunk_start = piece_end[:, None] + torch.arange(max_ahead, device=gamma.device)[None, :] * chunk_size
    last_token = torch.minimum(chunk_start + chunk_size, seq_end[:, None]) - 1
    outside = (chunk_start >= seq_end[:, None])[..., None]
    short = _chunks_short_of_threshold(gamma, last_token.clamp(min=0), outside, log_decay_threshold)
    return torch.minimum(piece_end[:, None] + (short + 1) * chunk_size, seq_end[:, None]).to(torch.int32)


def _chunks_short_of_threshold(gamma: torch.Tensor, last_token: torch.Tensor, outside: torch.Tensor,
                               log_decay_threshold: float) -> torch.Tensor:
    """[P, H]: for each piece and head, how many of the chunks listed by last_token ([P, n], the
    last token of each chunk, nearest the piece first) it takes in turn while their summed decay is
    still above the threshold. Chunks marked `outside` ([P, n, 1], past the sequence) add nothing."""
    decay = gamma[last_token].masked_fill(outside, 0.0)                                  # [P, n, H]
    # Scanned along the contiguous last dim: torch's scan over a middle dim took 0.35 ms at 131072 tokens.
    running = decay.transpose(1, 2).contiguous().double().cumsum(dim=-1)                 # [P, H, n]
    return (running > log_decay_threshold).sum(dim=-1)
