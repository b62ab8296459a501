"""CPU tests of the planning helpers (flashqla/hopper/chunk_plan.py)."""
import torch
import torch.nn.functional as F

import pytest

from flashqla.hopper import chunk_plan
from flashqla.hopper.chunk_plan import (
    FORWARD_PLAN_CACHE_SIZE, build_forward_plan, chunk_indices, chunk_offsets, plan_forward, plan_pieces,
    value_block_size, walk_starts,
)


def test_chunk_indices_cover_partial_and_empty_sequences():
    cu = torch.tensor([0, 100, 100, 164, 165], dtype=torch.int32)
    assert chunk_indices(cu).tolist() == [[0, 0], [0, 1], [2, 0], [3, 0]]
    assert chunk_offsets(cu).tolist() == [0, 2, 2, 3, 4]


def test_value_block_size_splits_only_when_heads_are_few():
    assert value_block_size(1, 64, max_block=64) == 64
    assert value_block_size(1, 8, max_block=64) == 32
    assert value_block_size(8, 64, max_block=128) == 128


def test_plan_pieces_splits_long_sequences_on_chunk_boundaries():
    cu = torch.tensor([0, 28672, 32768], dtype=torch.int32)
    pieces = plan_pieces(cu, num_heads=8, value_blocks=2, sm_count=132)
    assert pieces.shape[0] * 8 * 2 <= 132
    starts, ends = pieces[:, 1], pieces[:, 2]
    assert (starts[1:] == ends[:-1]).all() and starts[0] == 0 and ends[-1] == 32768
    assert all(int(s) % 64 == 0 for s in starts[pieces[:, 0] == 0])
    # the bounds as the caller holds them give the same plan without reading cu_seqlens back
    assert plan_pieces(cu, 8, 2, 132, host_bounds=cu.tolist()).tolist() == pieces.tolist()
    # each sequence ends in exactly one piece
    assert pieces[pieces[:, 3] == 1, 0].tolist() == [0, 1]


def test_plan_pieces_keeps_empty_sequences_and_does_not_split_busy_batches():
    cu = torch.tensor([0, 1000, 1000, 5000], dtype=torch.int32)
    pieces = plan_pieces(cu, num_heads=64, value_blocks=2, sm_count=132)
    assert pieces.tolist() == [[0, 0, 1000, 1], [1, 1000, 1000, 1], [2, 1000, 5000, 1]]


def test_walk_starts_stop_once_history_has_decayed():
    torch.manual_seed(0)
    T, H = 8192, 3
    g = F.logsigmoid(torch.randn(T, H)) / 16
    g[:, 0] = 0.0  # never decays: must walk from the sequence start
    gamma = g.view(-1, 64, H).cumsum(1).view(T, H)
    cu = torch.tensor([0, T], dtype=torch.int32)
    pieces = plan_pieces(cu, num_heads=H, value_blocks=2, sm_count=132, min_piece_chunks=16)
    walk = walk_starts(pieces, cu, gamma, log_decay_threshold=-10.0)
    for p in range(pieces.shape[0]):
        start = int(pieces[p, 1])
        assert int(walk[p, 0]) == 0
        for h in (1, 2):
            w = int(walk[p, h])
            assert w % 64 == 0 and w <= start
            if w > 0:
                assert g[w:start, h].sum() <= -10.0          # enough decay
                assert g[w + 64:start, h].sum() > -10.0      # and no more chunks than needed
    exact = walk_starts(pieces, cu, gamma, log_decay_threshold=float("-inf"))
    assert (exact == 0).all()


def test_plan_forward_matches_the_separate_helpers():
    cu = torch.tensor([0, 1000, 1000, 1064, 33832], dtype=torch.int32)
    plan = plan_forward(cu, num_heads=8, head_dim=128, sm_count=132, max_value_block=64)
    assert plan.chunk_index.tolist() == chunk_indices(cu).tolist()
    assert plan.chunk_offsets.tolist() == chunk_offsets(cu).tolist()
    assert plan.value_block == 64
    assert plan.pieces.tolist() == plan_pieces(cu, 8, 2, 132).tolist()
    back = [(s - int(cu[q])) // 64 for q, s, _, _ in plan.pieces.tolist()]
    assert plan.max_walk_back == max(back) > 0


def assert_same_plan(a, b):
    for name in ("chunk_index", "chunk_offsets", "pieces"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    assert (a.value_block, a.max_walk_back) == (b.value_block, b.max_walk_back)


PLAN_BOUNDS = [
    [0, 32768],                                   # one long sequence: split into pieces
    [0, 28672, 32768],
    [0, 1000, 1000, 1064, 1065, 33832],           # ragged, an empty and a one-token sequence
    [0, 8192, 16384, 24576, 32768],
    [0, 100],                                     # shorter than a piece: V split instead
]


@pytest.mark.parametrize("bounds", PLAN_BOUNDS)
@pytest.mark.parametrize("num_heads", [8, 64])
def test_cached_plan_equals_a_fresh_build(bounds, num_heads):
    cu = torch.tensor(bounds, dtype=torch.int32)
    cached = plan_forward(cu, num_heads, 128, 132, 64)
    fresh = build_forward_plan(bounds, cu.device, num_heads, 128, 132, 64)
    assert_same_plan(cached, fresh)
    assert plan_forward(cu, num_heads, 128, 132, 64) is cached
    assert plan_forward(cu, num_heads, 128, 132, 64, host_bounds=bounds) is cached


def test_plan_cache_is_keyed_by_every_argument():
    cu = torch.tensor([0, 28672, 32768], dtype=torch.int32)
    base = plan_forward(cu, 8, 128, 132, 64)
    assert plan_forward(torch.tensor([0, 28672, 32768], dtype=torch.int64), 8, 128, 132, 64) is base
    variants = {
        "bounds": plan_forward(torch.tensor([0, 4096, 32768], dtype=torch.int32), 8, 128, 132, 64),
        "heads": plan_forward(cu, 16, 128, 132, 64),
        "sm_count": plan_forward(cu, 8, 128, 528, 64),
        "max_value_block": plan_forward(cu, 8, 128, 132, 32),
        "min_piece_chunks": plan_forward(cu, 8, 128, 132, 64, min_piece_chunks=4),
        "host_bounds": plan_forward(cu, 8, 128, 132, 64, host_bounds=[0, 4096, 32768]),
    }
    for name, plan in variants.items():
        assert plan is not base, name
    # and each variant holds its own arguments' plan, not a neighbour's
    assert_same_plan(variants["heads"], build_forward_plan([0, 28672, 32768], cu.device, 16, 128, 132, 64))
    assert_same_plan(variants["sm_count"], build_forward_plan([0, 28672, 32768], cu.device, 8, 128, 528, 64))
    assert_same_plan(variants["host_bounds"], build_forward_plan([0, 4096, 32768], cu.device, 8, 128, 132, 64))
    assert variants["sm_count"].pieces.shape[0] > base.pieces.shape[0]
    assert variants["max_value_block"].value_block == 32 and base.value_block == 64


def test_plan_cache_is_keyed_by_device():
    cu = torch.tensor([0, 28672, 32768], dtype=torch.int32)
    on_cpu = plan_forward(cu, 8, 128, 132, 64)
    on_meta = plan_forward(cu.to("meta"), 8, 128, 132, 64, host_bounds=[0, 28672, 32768])
    assert on_meta is not on_cpu and on_meta.pieces.device.type == "meta"


def test_plan_cache_stays_small():
    chunk_plan._cached_forward_plan.cache_clear()
    first = plan_forward(torch.tensor([0, 64], dtype=torch.int32), 8)
    for n in range(2, FORWARD_PLAN_CACHE_SIZE + 2):
        plan_forward(torch.tensor([0, 64 * n], dtype=torch.int32), 8)
    assert chunk_plan._cached_forward_plan.cache_info().currsize == FORWARD_PLAN_CACHE_SIZE
    assert plan_forward(torch.tensor([0, 64], dtype=torch.int32), 8) is not first   # evicted, rebuilt


@pytest.mark.parametrize("bounds", PLAN_BOUNDS)
@pytest.mark.parametrize("threshold", [-10.0, -2.0, float("-inf")])
def test_walk_bounds_of_every_plan_lie_on_chunk_boundaries_of_their_sequence(bounds, threshold):
    """For each plan's pieces: a walk starts at a chunk boundary between its sequence start and its
    piece start, and ends (backward) at one between its piece end and its sequence end; -inf walks
    from the sequence edges, and at -2 some cut piece truncates its warm-up in each direction."""
    from flashqla.hopper.chunk_plan import walk_ends

    torch.manual_seed(1)
    num_heads = 4
    total = bounds[-1]
    g = F.logsigmoid(torch.randn(total, num_heads)) / 16
    g[:, 0] = 0.0   # a head that never decays
    cu = torch.tensor(bounds, dtype=torch.int32)
    plan = build_forward_plan(bounds, cu.device, num_heads, 128, 132, 64)
    chunk_local = torch.zeros_like(g)
    for start, end in zip(bounds, bounds[1:]):
        for c in range(start, end, 64):
            chunk_local[c:min(c + 64, end)] = g[c:min(c + 64, end)].cumsum(0)
    starts = walk_starts(plan.pieces, cu, chunk_local, threshold)
    ends = walk_ends(plan.pieces, cu, chunk_local, threshold)
    assert starts.dtype == ends.dtype == torch.int32
    assert starts.shape == ends.shape == (plan.pieces.shape[0], num_heads)
    truncated_start = truncated_end = False
    for (seq, first, end, _), walk_from, walk_to in zip(plan.pieces.tolist(), starts.tolist(), ends.tolist()):
        seq_start, seq_end = bounds[seq], bounds[seq + 1]
        for w, e in zip(walk_from, walk_to):
            assert seq_start <= w <= first and (w - seq_start) % 64 == 0
            assert end <= e <= seq_end and ((e - seq_start) % 64 == 0 or e == seq_end)
            if threshold == float("-inf"):
                assert (w, e) == (seq_start, seq_end)
            truncated_start |= seq_start < w < first
            truncated_end |= end < e < seq_end
        assert (walk_from[0], walk_to[0]) == (seq_start, seq_end)   # the head without decay
    if plan.max_walk_back > 0 and threshold == -2.0:
        assert truncated_start and truncated_end


def test_chunk_states_takes_the_plans_offsets_only_with_their_chunk_count():
    """offsets without num_chunks (or the reverse) would size the states from a guess: refused."""
    from flashqla.hopper.chunk_plan import chunk_offsets
    from flashqla.hopper.chunk_states import chunk_states

    cu = torch.tensor([0, 100, 164], dtype=torch.int32)
    k, v = torch.zeros(164, 1, 128, dtype=torch.bfloat16), torch.zeros(164, 1, 128, dtype=torch.bfloat16)
    gamma, beta, inverse = torch.zeros(164, 1), torch.zeros(164, 1), torch.zeros(164, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets and num_chunks together"):
        chunk_states(k, v, gamma, beta, inverse, None, cu, offsets=chunk_offsets(cu))
    with pytest.raises(ValueError, match="offsets and num_chunks together"):
        chunk_states(k, v, gamma, beta, inverse, None, cu, num_chunks=3)


def test_pieces_cut_a_dominant_sequence_even_past_one_cta_per_sm():
    """8/24 heads, 28672 + 4096 tokens, 48 CTAs a piece: one piece per sequence fills only 96 SMs but
    walks 448 chunks; cutting the long one gives more CTAs than SMs and a much shorter walk."""
    from flashqla.hopper.chunk_plan import _split_rows, _walk_makespan

    bounds = [0, 28672, 32768]
    plan = build_forward_plan(bounds, torch.device("cpu"), 24, 128, 132, 64)
    rows = [tuple(r) for r in plan.pieces.tolist()]
    longest = max(-(-(end - start) // 64) for _, start, end, _ in rows)
    assert plan.value_block == 64 and longest <= 256
    assert len(rows) * 24 * 2 > 132
    unsplit = _split_rows(bounds, [448, 64], None, 64)
    assert _walk_makespan(rows, bounds, 48, 132, 64) < 0.6 * _walk_makespan(unsplit, bounds, 48, 132, 64)


def test_walk_makespan_counts_waves_and_warmup():
    from flashqla.hopper.chunk_plan import PLANNED_WARMUP_CHUNKS, _walk_makespan

    bounds = [0, 64 * 100]
    one_piece = [(0, 0, 6400, 1)]
    assert _walk_makespan(one_piece, bounds, 132, 132, 64) == 100
    assert _walk_makespan(one_piece, bounds, 133, 132, 64) == 200   # one CTA waits for a free SM
    two_pieces = [(0, 0, 3200, 0), (0, 3200, 6400, 1)]
    assert _walk_makespan(two_pieces, bounds, 66, 132, 64) == 50 + PLANNED_WARMUP_CHUNKS


def test_walk_ends_stop_once_the_future_has_decayed():
    """The backward's mirror of walk_starts: each cut piece's reverse walk starts the fewest chunks
    after its end whose summed decay reaches the threshold, or at the sequence end."""
    from flashqla.hopper.chunk_plan import walk_ends

    torch.manual_seed(1)
    bounds = [0, 8192, 8192 + 3000]
    T, H = bounds[-1], 3
    g = F.logsigmoid(torch.randn(T, H)) / 16
    g[:, 0] = 0.0  # never decays: every walk starts at its sequence end
    # chunk-local cumsum: chunks restart at every sequence start
    gamma = torch.cat([g[c:min(c + 64, b)].cumsum(0) for a, b in zip(bounds, bounds[1:]) for c in range(a, b, 64)])
    plan = build_forward_plan(bounds, torch.device("cpu"), H, 128, 132, 64)
    assert plan.max_walk_back > 0
    ends = walk_ends(plan.pieces, torch.tensor(bounds, dtype=torch.int32), gamma, -10.0)
    for p, (seq, start, end, last) in enumerate(plan.pieces.tolist()):
        seq_end = bounds[seq + 1]
        assert int(ends[p, 0]) == seq_end
        for h in (1, 2):
            e = int(ends[p, h])
            assert end <= e <= seq_end and ((e - bounds[seq]) % 64 == 0 or e == seq_end)
            if last:
                assert e == seq_end
            elif e < seq_end:
                assert g[end:e, h].sum() <= -10.0             # enough decay
                assert g[end:e - 64, h].sum() > -10.0         # and no more chunks than needed
            else:
                assert g[end:seq_end - 64 if seq_end - end > 64 else end, h].sum() > -10.0
    exact = walk_ends(plan.pieces, torch.tensor(bounds, dtype=torch.int32), gamma, float("-inf"))
    assert exact.tolist() == [[bounds[s + 1]] * H for s in plan.pieces[:, 0].tolist()]


def test_empty_sequences_do_not_stop_a_long_one_from_being_cut():
    bounds = [0, 131072] + [131072] * 16  # one long sequence, 16 empty ones
    plan = build_forward_plan(bounds, torch.device("cpu"), 16, 128, 132, 64)
    rows = plan.pieces.tolist()
    assert sum(1 for seq, *_ in rows if seq == 0) > 1
    assert [r[0] for r in rows if r[3] == 1] == list(range(17))


def test_the_reverse_walk_reuses_the_cached_forward_plan():
    """backward.py walks the forward plan's pieces, from plan_forward's cache: with the host bounds given, the next
    call returns the same tensors (nothing copied to the device, which would wait for the GPU)."""
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK

    bounds = [0, 32768, 40000, 40001]
    cu = torch.tensor(bounds, dtype=torch.int32)
    plan = plan_forward(cu, 8, 128, 132, MAX_VALUE_BLOCK, host_bounds=bounds)
    # 8 heads x one V block (all 128 columns a CTA, as the reverse walk's CTAs take them) ...
    assert plan.value_block == 128
    assert plan.pieces.tolist() == plan_pieces(cu, 8, 1, 132, host_bounds=bounds).tolist()
    # ... and the same tensor on the next call
    assert plan_forward(cu, 8, 128, 132, MAX_VALUE_BLOCK, host_bounds=bounds).pieces is plan.pieces


def test_ragged_cuts_fill_the_last_wave():
    """16/48 heads x 32768 tokens (512 chunks, 48 CTAs a piece): five equal pieces are 240 CTAs, two waves of 103
    chunks; with ragged_cuts (a candidate) pieces of 94 chunks and a last one of 42 are 288 CTAs whose short ones
    fill the second wave. Without it the plan is the equal one."""
    from flashqla.hopper.chunk_plan import _walk_makespan

    bounds = [0, 32768]
    equal = [tuple(r) for r in build_forward_plan(bounds, torch.device("cpu"), 48, 128, 132).pieces.tolist()]
    ragged = [tuple(r) for r in build_forward_plan(bounds, torch.device("cpu"), 48, 128, 132,
                                                   ragged_cuts=True).pieces.tolist()]
    assert [(end - start) // 64 for _, start, end, _ in equal] == [103] * 4 + [100]
    assert [(end - start) // 64 for _, start, end, _ in ragged] == [94] * 5 + [42]
    assert [r[3] for r in ragged] == [0] * 5 + [1]
    assert all(a[2] == b[1] for a, b in zip(ragged, ragged[1:])) and ragged[-1][2] == 32768
    assert _walk_makespan(ragged, bounds, 48, 132, 64) < 0.95 * _walk_makespan(equal, bounds, 48, 132, 64)
    # keyed in the cache: each flag gets its own plan
    cu = torch.tensor(bounds, dtype=torch.int32)
    assert plan_forward(cu, 48, ragged_cuts=True).pieces.shape[0] == 6 and plan_forward(cu, 48).pieces.shape[0] == 5
    # the model's layouts (one CTA a piece per SM already) keep their equal pieces
    model = build_forward_plan([0, 131072], torch.device("cpu"), 16, 128, 132, ragged_cuts=True).pieces.tolist()
    assert {(end - start) // 64 for _, start, end, _ in model} == {256}
