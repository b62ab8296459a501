"""GPU tests of the TileLang forward (flashqla/hopper/forward.py and its kernels) against the float64 references.

Needs an SM90 GPU: skipped elsewhere. Grid: head layouts x lengths (tests/flashqla/hopper_grid.py) x initial state.
"""
import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, TOLERANCE, assert_slices_close, float64_reference,
                         make_inputs, on_hopper, poison_allocator)

pytestmark = pytest.mark.gpu

if not on_hopper:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from flashqla.hopper.forward import forward  # noqa: E402  (imports tilelang; only where the kernels can run)


def run_forward(inputs, **kwargs):
    poison_allocator()
    return forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None,
                   inputs["initial_state"], True, inputs["cu_seqlens"], **kwargs)


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_forward_matches_float64_reference(heads, lengths, with_initial_state):
    inputs = make_inputs(LENGTHS[lengths], *heads, with_initial_state, seed=heads[1] * 10 + list(LENGTHS).index(lengths))
    o, final_state = run_forward(inputs)
    torch.cuda.synchronize()
    assert o.shape == inputs["v"].shape and o.dtype == inputs["v"].dtype
    assert torch.isfinite(o).all(), "NaN/Inf in o (unwritten rows?)"
    assert torch.isfinite(final_state).all()
    ref_o, ref_state = float64_reference(inputs)
    err_o = relative_error(o, ref_o)
    err_state = relative_error(final_state, ref_state)
    assert err_o <= TOLERANCE, f"o relative L2 error {err_o:.3e}"
    assert err_state <= TOLERANCE, f"final state relative L2 error {err_state:.3e}"
    assert_slices_close({"o": o, "final_state": final_state}, {"o": ref_o, "final_state": ref_state}, LENGTHS[lengths])


@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_forward_is_bitwise_deterministic(heads):
    """o, the final state and every kept tensor (gamma, A~ and the walk's chunk states)."""
    inputs = make_inputs(RAGGED + [4096], *heads, with_initial_state=True, seed=7)
    o1, s1 = run_forward(inputs)
    o2, s2 = run_forward(inputs)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    first, second = (run_forward(inputs, keep_for_backward=True) for _ in range(2))
    for a, b in zip(first[:2] + tuple(first[2]), second[:2] + tuple(second[2])):
        assert torch.equal(a, b)


def assert_matches_float64(inputs, o, final_state):
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(final_state).all()
    ref_o, ref_state = float64_reference(inputs)
    assert relative_error(o, ref_o) <= TOLERANCE
    assert relative_error(final_state, ref_state) <= TOLERANCE


def test_forward_other_dtypes_and_groups():
    """float16 q/k/v; bf16 beta (the model's); a group of 16 value heads per qk head."""
    inputs = make_inputs([777, 1536], 4, 16, with_initial_state=True, dtype=torch.float16, seed=3)
    o, final_state = run_forward(inputs)
    assert o.dtype == torch.float16
    assert_matches_float64(inputs, o, final_state)
    inputs = make_inputs([777, 1536], 4, 16, with_initial_state=True, seed=4)
    inputs["beta"] = inputs["beta"].to(torch.bfloat16)
    assert_matches_float64(inputs, *run_forward(inputs))
    inputs = make_inputs([1000, 129], 1, 16, with_initial_state=False, seed=6)
    assert_matches_float64(inputs, *run_forward(inputs))


def test_chunk_states_match_fused_forward_final_state():
    """The state-only kernel's final state equals the fused kernel's, and its first chunk state is h0."""
    from flashqla.hopper.chunk_plan import chunk_bounds, chunk_offsets
    from flashqla.hopper.chunk_states import chunk_states
    from flashqla.hopper.inverse import gamma_and_inverse

    inputs = make_inputs(RAGGED, 2, 8, with_initial_state=True, seed=11)
    cu = inputs["cu_seqlens"]
    gamma, inverse = gamma_and_inverse(inputs["k"][0], inputs["g"][0], inputs["beta"][0], chunk_bounds(cu))
    states, final_state, _ = chunk_states(inputs["k"][0], inputs["v"][0], gamma, inputs["beta"][0], inverse,
                                          inputs["initial_state"], cu, value_block=64)
    _, ref_state = float64_reference(inputs)
    assert relative_error(final_state, ref_state) <= TOLERANCE
    offsets = chunk_offsets(cu).tolist()
    for n, length in enumerate(RAGGED):
        if length:
            first = states[offsets[n]].float()
            assert relative_error(first, inputs["initial_state"][n]) <= 1e-2


def test_chunk_states_transition_composes():
    """S_end = M S_start + S_end|0 for the transition M of a sequence."""
    from flashqla.hopper.chunk_plan import chunk_bounds
    from flashqla.hopper.chunk_states import chunk_states
    from flashqla.hopper.inverse import gamma_and_inverse

    inputs = make_inputs([1000, 2048], 2, 8, with_initial_state=True, seed=5)
    cu = inputs["cu_seqlens"]
    gamma, inverse = gamma_and_inverse(inputs["k"][0], inputs["g"][0], inputs["beta"][0], chunk_bounds(cu))
    args = (inputs["k"][0], inputs["v"][0], gamma, inputs["beta"][0], inverse)
    _, zero_start, transition = chunk_states(*args, None, cu, value_block=64, store_chunk_states=False,
                                             with_transition=True)
    _, with_h0, _ = chunk_states(*args, inputs["initial_state"], cu, value_block=64, store_chunk_states=False)
    composed = transition @ inputs["initial_state"] + zero_start
    assert relative_error(composed, with_h0) <= TOLERANCE


def test_rejects_other_head_dims():
    inputs = make_inputs([128], 2, 8, with_initial_state=False)
    with pytest.raises(ValueError, match="K = V = 128"):
        forward(inputs["q"][..., :64], inputs["k"][..., :64], inputs["v"], inputs["g"], inputs["beta"],
                       None, None, False, inputs["cu_seqlens"])


@pytest.mark.parametrize("lengths", [[32768], [28672, 4096], [8192] * 4], ids=["1x32768", "28672+4096", "8192x4"])
def test_split_sequences_exact_and_truncated(lengths):
    """Pieces of split sequences (2/8 heads: few CTAs) rebuild their entering state by a warm-up walk;
    exact (-inf) and truncated (-10) histories both match the reference, including a head with no decay."""
    inputs = make_inputs(lengths, 2, 8, with_initial_state=True, seed=21)
    ref_o, ref_state = float64_reference(inputs)
    for threshold in (float("-inf"), -10.0):
        poison_allocator()
        o, final_state = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None,
                                        inputs["initial_state"], True, inputs["cu_seqlens"],
                                        log_decay_threshold=threshold)
        assert relative_error(o, ref_o) <= TOLERANCE, threshold
        assert relative_error(final_state, ref_state) <= TOLERANCE, threshold
