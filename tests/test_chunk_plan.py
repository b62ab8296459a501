"""CPU tests of the planning helpers (flashqla/hopper/chunk_plan.py)."""
import torch
import torch.nn.functional as F

from flashqla.hopper.chunk_plan import (
    chunk_indices, chunk_offsets, plan_forward, plan_pieces, value_block_size, walk_starts,
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


def test_plan_forward_uses_host_bounds_when_given():
    cu = torch.tensor([0, 1000, 5000], dtype=torch.int32)
    from_device = plan_forward(cu, num_heads=8, sm_count=132, max_value_block=64)
    from_host = plan_forward(cu, num_heads=8, sm_count=132, max_value_block=64, host_bounds=[0, 1000, 5000])
    assert from_host.pieces.tolist() == from_device.pieces.tolist()
    assert from_host.chunk_index.tolist() == from_device.chunk_index.tolist()
