"""Where each piece's CTA starts the forward's walk, or ends the backward's reverse walk: the
decay-truncated warm-up of docs/gdn-math.md §4 in one kernel. Its torch definition,
chunk_plan.walk_starts / walk_ends, took 0.30-0.61 ms a forward + backward at the bench's cut shapes
on the H200 (a dozen small ops); this takes 0.011-0.016 ms, bitwise the same bounds
(tests/flashqla/test_hopper_walk_bounds.py).

One warp per (piece, head) sums the decays of the chunks next to its piece (gamma at each chunk's last
token), nearest first, 32 chunks a step: a float64 prefix sum over the lanes plus the steps before.
The first chunk where the sum reaches the threshold sets the bound (the walk takes that many chunks);
a head that never gets there walks from its sequence's start (forward) or end (backward), exactly.
With g <= 0 the sums only fall, so the first crossing is what the torch ops' count of chunks still
above the threshold gives.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import PIECE_FIELDS
from flashqla.hopper.common import CHUNK_SIZE, DEFAULT_LOG_DECAY_THRESHOLD, compile_for_hopper

_THREADS = 128
_LANES = 32
_WARPS = _THREADS // _LANES
_NOT_FOUND = 2 ** 30


def walk_bounds_program(ahead: bool, chunk_size: int = CHUNK_SIZE):
    """ahead=False: the forward's walk starts (chunks before each piece); True: the backward's walk
    ends (chunks after it)."""
    num_tokens = T.dynamic("num_tokens")
    num_heads = T.dynamic("num_heads")
    num_pieces = T.dynamic("num_pieces")
    num_sequences = T.dynamic("num_sequences")

    @T.prim_func
    def walk_bounds_kernel(
        gamma: T.Tensor((num_tokens, num_heads), "float32"),
        pieces: T.Tensor((num_pieces, PIECE_FIELDS), "int32"),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        bounds: T.Tensor((num_pieces, num_heads), "int32"),
        log_decay_threshold: T.float64,
    ):
        with T.Kernel(num_pieces, T.ceildiv(num_heads, _WARPS), threads=_THREADS) as (piece, head_block):
            thread = T.get_thread_binding()
            lane = thread % _LANES
            head, edge, limit, chunks, result, done = (T.alloc_var("int32") for _ in range(6))
            nearest, token, first = (T.alloc_var("int32") for _ in range(3))
            carry, decay, shifted = (T.alloc_var("float64") for _ in range(3))
            head = head_block * _WARPS + thread // _LANES
            if ahead:
                edge = pieces[piece, 2]
                limit = cu_seqlens[pieces[piece, 0] + 1]
                chunks = T.ceildiv(limit - edge, chunk_size)
            else:
                edge = pieces[piece, 1]
                limit = cu_seqlens[pieces[piece, 0]]
                chunks = (edge - limit) // chunk_size
            result = limit
            done = 0
            carry = 0.0
            if head < num_heads:
                for step in T.serial(T.ceildiv(chunks, _LANES)):
                    if done == 0:
                        nearest = step * _LANES + lane + 1  # this lane's chunk, counted from the piece
                        if ahead:
                            token = T.min(edge + nearest * chunk_size, limit) - 1
                        else:
                            token = T.max(edge - (nearest - 1) * chunk_size - 1, 0)
                        decay = T.if_then_else(nearest <= chunks, T.cast(gamma[token, head], "float64"), 0.0)
                        for offset in (1, 2, 4, 8, 16):  # inclusive prefix sum over the lanes
                            shifted = T.shfl_up(decay, offset)
                            decay = decay + T.if_then_else(lane >= offset, shifted, 0.0)
                        first = T.if_then_else((nearest <= chunks) & (carry + decay <= log_decay_threshold),
                                               nearest, _NOT_FOUND)
                        for offset in (16, 8, 4, 2, 1):  # the nearest chunk that crossed, on every lane
                            first = T.min(first, T.shfl_xor(first, offset))
                        carry = carry + T.shfl_sync(decay, _LANES - 1)
                        if first < _NOT_FOUND:
                            done = 1
                            if ahead:
                                result = T.min(edge + first * chunk_size, limit)
                            else:
                                result = T.max(edge - first * chunk_size, limit)
                if lane == 0:
                    bounds[piece, head] = result

    return walk_bounds_kernel


@functools.lru_cache(maxsize=None)
def compile_walk_bounds(ahead: bool, chunk_size: int = CHUNK_SIZE):
    return compile_for_hopper(walk_bounds_program(ahead, chunk_size))


def walk_bounds(gamma: torch.Tensor, pieces: torch.Tensor, cu_seqlens: torch.Tensor, ahead: bool,
                log_decay_threshold: float = DEFAULT_LOG_DECAY_THRESHOLD) -> torch.Tensor:
    """int32 [P, H]: for each piece and head, the token the forward's walk starts at (ahead=False,
    chunk_plan.walk_starts' definition) or the backward's walk ends at (ahead=True, walk_ends).
    gamma: float32 [T, H], the chunk-local cumsum of g; pieces: ForwardPlan.pieces; cu_seqlens: int32."""
    num_pieces, num_heads = pieces.shape[0], gamma.shape[1]
    if log_decay_threshold == float("-inf") or num_pieces == 0:
        edge = cu_seqlens.long()[pieces[:, 0].long() + (1 if ahead else 0)]
        return edge.to(torch.int32)[:, None].expand(num_pieces, num_heads).contiguous()
    bounds = torch.empty(num_pieces, num_heads, dtype=torch.int32, device=gamma.device)
    compile_walk_bounds(ahead)(gamma.contiguous(), pieces, cu_seqlens, bounds, float(log_decay_threshold))
    return bounds
