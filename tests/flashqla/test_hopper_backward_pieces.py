"""The backward_pieces candidate (flashqla/hopper/candidates.py): the state-gradient walk runs in the
forward plan's pieces, each CTA starting from a decay-truncated warm-up after its piece
(chunk_plan.walk_ends), instead of one CTA per whole sequence.

Run on an H200 with `pytest -m gpu -s` (tools/device_session.sh's `candidates` part). What decides:
with the exact threshold (-inf) the pieces give bitwise the whole-sequence walk's state gradients;
with the default threshold every gradient stays within the float64 tolerance on sequences the planner
cuts (strong decay, heads that never decay, h0 on and off, several sequences), deterministic; and
the timing test shows the backward faster where the heads are few.
"""
import pytest
import torch

from hopper_grid import (GRAD_NAMES, TOLERANCE, assert_close_to_reference, float64_gradients, make_backward_inputs,
                         on_hopper, poison_allocator)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]
SCALE = 128 ** -0.5
# (heads, lengths) the planner cuts into pieces: 2 to 8 pieces a sequence
# (the last-but-one: an empty sequence, partial last chunks, a sequence too short to cut)
CUT_CASES = {"2_8_32768": ((2, 8), [32768]), "2_8_28672+4096": ((2, 8), [28672, 4096]),
             "8_24_28672+4096": ((8, 24), [28672, 4096]), "4_16_ragged": ((4, 16), [8192, 1000, 0, 3000]),
             "16_16_65536": ((16, 16), [65536])}


def backward_with(inputs, do, dht, pieces: bool, poison: bool = True):
    from flashqla.hopper import candidates
    from flashqla.hopper.backward import backward

    if poison:  # NaN in every free block, so unwritten outputs show
        poison_allocator()
    with candidates.use(*(("backward_pieces",) if pieces else ())):
        return backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], SCALE,
                        inputs["initial_state"], inputs["cu_seqlens"], do, dht)


def _plan_and_gamma(inputs):
    from flashqla import hopper
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward

    num_tokens, num_v_heads = inputs["g"].shape[1:]
    cu = inputs["cu_seqlens"]
    plan = plan_forward(cu, num_v_heads, 128, device_sm_count(cu.device), hopper.MAX_VALUE_BLOCK)
    gamma = hopper.chunk_local_cumsum(inputs["g"], cu, chunk_index=plan.chunk_index).view(num_tokens, num_v_heads)
    return plan, gamma


@pytest.mark.parametrize("case", list(CUT_CASES))
def test_exact_pieces_give_bitwise_the_whole_sequence_walk(case):
    """walk_ends(-inf) starts every piece's walk at its sequence end, so each piece repeats the
    whole-sequence walk's steps for its own chunks: the same bits."""
    from flashqla.hopper.backward_state_grads import state_gradients
    from flashqla.hopper.chunk_plan import walk_ends
    from flashqla.hopper.inverse import gated_products

    heads, lengths = CUT_CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    plan, gamma = _plan_and_gamma(inputs)
    assert plan.walk_ahead_index is not None, "the planner did not cut this case"
    q, k = inputs["q"][0], inputs["k"][0]
    beta = inputs["beta"][0]
    ab, p, _ = gated_products(q, k, gamma, beta, SCALE, inputs["cu_seqlens"], plan.chunk_index)
    args = (q, k, gamma, ab, p, do[0], dht, SCALE, inputs["cu_seqlens"], plan.chunk_offsets,
            plan.chunk_index.shape[0], plan.value_block)
    whole = state_gradients(*args)
    ends = walk_ends(gamma, plan.walk_ahead_index, float("-inf"))
    pieces = state_gradients(*args, pieces=plan.pieces, walk_end=ends)
    assert torch.equal(whole[0], pieces[0]) and torch.equal(whole[1], pieces[1])


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("case", list(CUT_CASES))
def test_backward_in_pieces_matches_float64(case, with_initial_state):
    heads, lengths = CUT_CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, with_initial_state, strong_decay=True)
    assert _plan_and_gamma(inputs)[0].walk_ahead_index is not None, "the planner did not cut this case"
    ours = backward_with(inputs, do, dht, pieces=True)
    for name, grad in zip(GRAD_NAMES, ours):
        assert torch.isfinite(grad).all(), name
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht))


def test_backward_in_pieces_stays_close_to_the_whole_walk_and_is_deterministic():
    from flashqla.testing import relative_error

    inputs, do, dht = make_backward_inputs([28672, 4096], 2, 8, True)
    first = backward_with(inputs, do, dht, pieces=True)
    second = backward_with(inputs, do, dht, pieces=True)
    whole = backward_with(inputs, do, dht, pieces=False)
    for name, a, b, w in zip(GRAD_NAMES, first, second, whole):
        assert torch.equal(a, b), name
        assert relative_error(a, w) <= TOLERANCE / 10, name


@pytest.mark.parametrize("case", ["2_8_28672+4096", "4_16_ragged"])
def test_public_op_with_kept_forward_and_pieces_matches_float64(case):
    """How training runs it: the forward keeps its tensors (the default), the backward walks in pieces."""
    import flashqla
    from flashqla.hopper import candidates

    heads, lengths = CUT_CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [inputs[n].clone().requires_grad_() for n in names]
    poison_allocator()
    with candidates.use("backward_pieces"):
        o, final_state = flashqla.chunk_gated_delta_rule(
            *leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=inputs["cu_seqlens"],
            backend="tilelang")
        torch.autograd.backward((o, final_state), (do, dht))
    grads = [leaf.grad for leaf in leaves]
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert_close_to_reference(grads, float64_gradients(inputs, do, dht))


@pytest.mark.parametrize("heads,lengths", [((16, 16), [131072]), ((2, 8), [131072]), ((16, 16), [32768])],
                         ids=["16_16_131072", "2_8_131072", "16_16_32768"])
def test_backward_pieces_time(heads, lengths):
    """Prints do_bench medians of the backward with and without the candidate (run with -s), on the
    bench's inputs: every head decays (a head that never decays walks its whole sequence either way)."""
    from triton.testing import do_bench

    from flashqla.bench import make_inputs

    inputs = make_inputs(heads, lengths)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(inputs["v"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, device="cuda")
    times = {}
    for name, pieces in (("whole", False), ("pieces", True)):
        times[name] = do_bench(lambda: backward_with(inputs, do, dht, pieces, poison=False), warmup=10, rep=200,
                               return_mode="median")
    print(f"\nbackward {heads[0]}/{heads[1]} {'+'.join(map(str, lengths))}: whole-sequence walk "
          f"{times['whole']:.3f} ms, in pieces {times['pieces']:.3f} ms ({times['whole'] / times['pieces']:.2f}x)")
    assert times["pieces"] < times["whole"]
