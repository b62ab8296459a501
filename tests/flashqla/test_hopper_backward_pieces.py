"""The reverse walk in pieces (`hopper.backward` on sequences the forward's plan cuts): each piece's CTA
starts from a decay-truncated warm-up after its piece (walk_bounds.py) instead of one CTA walking the
whole sequence.

With the exact threshold (-inf) the pieces give bitwise the whole-sequence walk's gradients;
with the default threshold every gradient stays within the float64 tolerance on sequences the planner
cuts (strong decay, heads that never decay, h0 on and off, several sequences), deterministic; with the
plan's candidate ragged cuts too (forward and backward against float64).
"""
import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (GRAD_NAMES, TOLERANCE, assert_close_to_reference, float64_gradients, float64_reference,
                         make_backward_inputs, on_hopper, poison_allocator)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]
SCALE = 128 ** -0.5
# (heads, lengths) the planner cuts into pieces: 2 to 8 pieces a sequence
# (the last-but-one: an empty sequence, partial last chunks, a sequence too short to cut)
CUT_CASES = {"2_8_32768": ((2, 8), [32768]), "2_8_28672+4096": ((2, 8), [28672, 4096]),
             "8_24_28672+4096": ((8, 24), [28672, 4096]), "4_16_ragged": ((4, 16), [8192, 1000, 0, 3000]),
             "16_16_65536": ((16, 16), [65536])}


def backward_with(inputs, do, dht, exact: bool = False, kept=None, ragged_cuts: bool = False):
    """exact: pieces walk from their sequence end (threshold -inf), bitwise the whole-sequence walk.
    ragged_cuts: the plan's candidate (what the forward of `kept` was given)."""
    from flashqla.hopper.backward import backward
    from flashqla.hopper.common import DEFAULT_LOG_DECAY_THRESHOLD

    poison_allocator()  # NaN in every free block, so unwritten outputs show
    return backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], SCALE,
                    inputs["initial_state"], inputs["cu_seqlens"], do, dht, kept=kept,
                    log_decay_threshold=float("-inf") if exact else DEFAULT_LOG_DECAY_THRESHOLD,
                    ragged_cuts=ragged_cuts)


def _plan(inputs, ragged_cuts: bool = False):
    """The forward's plan for these inputs, whose pieces the reverse walk walks (backward.py)."""
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK

    cu = inputs["cu_seqlens"]
    return plan_forward(cu, inputs["g"].shape[2], 128, device_sm_count(cu.device), MAX_VALUE_BLOCK,
                        ragged_cuts=ragged_cuts)


@pytest.mark.parametrize("case", list(CUT_CASES))
def test_exact_pieces_give_bitwise_the_whole_sequence_walk(case):
    """Threshold -inf starts every piece's walk at its sequence end, so each piece repeats the
    whole-sequence walk's steps for its own chunks: the same bits as one piece a sequence."""
    from flashqla.hopper.backward_fused import fused_backward_grads
    from flashqla.hopper.forward import forward
    from flashqla.hopper.walk_bounds import walk_bounds

    heads, lengths = CUT_CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    plan = _plan(inputs)
    assert plan.max_walk_back > 0, "the planner did not cut this case"
    cu = inputs["cu_seqlens"]
    _, _, kept = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], SCALE,
                         inputs["initial_state"], False, cu, keep_for_backward=True)
    bounds = cu.tolist()
    whole_sequences = torch.tensor([[n, bounds[n], bounds[n + 1], 1] for n in range(len(bounds) - 1)],
                                   dtype=torch.int32, device=cu.device)

    def walk(pieces):
        ends = walk_bounds(kept.gamma, pieces, cu, ahead=True, log_decay_threshold=float("-inf"))
        poison_allocator()
        return fused_backward_grads(inputs["q"][0], inputs["k"][0], inputs["v"][0], kept.gamma,
                                    inputs["beta"][0].float().contiguous(), kept.inverse, kept.chunk_states, do[0],
                                    dht.contiguous(), SCALE, cu, plan.chunk_offsets, pieces, ends)

    for name, whole, pieces in zip(GRAD_NAMES, walk(whole_sequences), walk(plan.pieces)):
        assert torch.equal(whole, pieces), name


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("case", list(CUT_CASES))
def test_backward_in_pieces_matches_float64(case, with_initial_state):
    heads, lengths = CUT_CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, with_initial_state, strong_decay=True)
    assert _plan(inputs).max_walk_back > 0, "the planner did not cut this case"
    ours = backward_with(inputs, do, dht)
    for name, grad in zip(GRAD_NAMES, ours):
        assert torch.isfinite(grad).all(), name
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht))


def test_backward_in_pieces_stays_close_to_the_whole_walk_and_is_deterministic():
    inputs, do, dht = make_backward_inputs([28672, 4096], 2, 8, True)
    first = backward_with(inputs, do, dht)
    second = backward_with(inputs, do, dht)
    whole = backward_with(inputs, do, dht, exact=True)
    for name, a, b, w in zip(GRAD_NAMES, first, second, whole):
        assert torch.equal(a, b), name
        assert relative_error(a, w) <= TOLERANCE / 10, name


@pytest.mark.parametrize("case", ["2_8_28672+4096", "4_16_ragged"])
def test_kept_forward_with_pieces_matches_float64(case):
    """How training would run it: the forward keeps its tensors (the public op's default), the
    backward walks in pieces."""
    from flashqla.hopper.forward import forward

    heads, lengths = CUT_CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    poison_allocator()
    _, _, kept = forward(*args, SCALE, inputs["initial_state"], True, inputs["cu_seqlens"], keep_for_backward=True)
    grads = backward_with(inputs, do, dht, kept=kept)
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert_close_to_reference(grads, float64_gradients(inputs, do, dht))


@pytest.mark.parametrize("lengths", [[32768], [28672, 4096]], ids=["32768", "28672+4096"])
def test_ragged_cuts_match_float64(lengths):
    """The plan's candidate ragged cuts (pieces of S chunks and a shorter last one, chunk_plan._piece_rows) at 8/24,
    where they change the plan: the forward keeping its tensors (o, final state) and the backward from them
    (every gradient, per (sequence, head) too) against float64, with heads that never decay and strong decay."""
    from flashqla.hopper.forward import forward

    inputs, do, dht = make_backward_inputs(lengths, 8, 24, True, strong_decay=True)
    equal, ragged = _plan(inputs).pieces.tolist(), _plan(inputs, ragged_cuts=True).pieces.tolist()
    assert ragged != equal, "ragged cuts did not change this case's plan"
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    poison_allocator()
    o, final_state, kept = forward(*args, SCALE, inputs["initial_state"], True, inputs["cu_seqlens"],
                                   keep_for_backward=True, ragged_cuts=True)
    ref_o, ref_state = float64_reference(inputs)
    errors = {"o": relative_error(o, ref_o), "final_state": relative_error(final_state, ref_state)}
    assert all(error <= TOLERANCE for error in errors.values()), errors
    grads = backward_with(inputs, do, dht, kept=kept, ragged_cuts=True)
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert_close_to_reference(grads, float64_gradients(inputs, do, dht), lengths)
