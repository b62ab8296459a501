"""GPU tests of the backward in one reverse walk (flashqla/hopper/backward_fused.py, the op's backward): every
gradient against autograd through the float64 chunked reference on the backward's grid, against the
two-kernel backward where sequences are cut into pieces and where q, k go through the in-kernel L2 norm (also
with the norm's backward inside the walk), and bitwise determinism."""
import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (GRAD_NAMES, HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, assert_close_to_reference,
                         float64_gradients, make_backward_inputs, on_hopper, poison_allocator, sequence_head_errors)


def run_backward(inputs, do, dht, fused_reverse=True, **keywords):
    from flashqla.hopper.backward import backward

    poison_allocator()
    return backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], 128 ** -0.5,
                    inputs["initial_state"], inputs["cu_seqlens"], do, dht, fused_reverse=fused_reverse, **keywords)


def assert_close_to_two_kernels(fused, two_kernels, seq_lens, bound=1e-2):
    """Every gradient of the fused walk within `bound` (relative L2) of the two-kernel backward's, whole and
    per (sequence, head) within 2 x bound; the worst of each in the message."""
    failures = []
    for name, a, b in zip(GRAD_NAMES, fused, two_kernels):
        whole = float(relative_error(a, b))
        slices = sequence_head_errors(a, b, None if name == "dh0" else seq_lens)
        if not (whole <= bound and slices.worst <= 2 * bound):  # also catches NaN
            failures.append(f"{name}: {whole:.2e} whole, {slices.worst:.2e} at (sequence, head) {slices.worst_index}")
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_fused_backward_matches_float64_reference(heads, lengths, with_initial_state):
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, with_initial_state)
    ours = run_backward(inputs, do, dht)
    assert ours[0].dtype == torch.bfloat16 and ours[3].dtype == torch.float32 and ours[5].dtype == torch.float32
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht), LENGTHS[lengths])


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("lengths", ["1x4096", "ragged"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_fused_backward_strong_decay(heads, lengths):
    """A quarter of the heads with g = 0, a quarter with g down to -20 per token."""
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, True, strong_decay=True)
    assert_close_to_reference(run_backward(inputs, do, dht), float64_gradients(inputs, do, dht), LENGTHS[lengths])


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("threshold", [-10.0, float("-inf")], ids=["truncated", "exact"])
@pytest.mark.parametrize("seq_lens", [[65536], [40000, 3, 24000]], ids=["1x65536", "three"])
def test_fused_backward_in_pieces_matches_two_kernels(seq_lens, threshold):
    """2/8 heads: sequences long enough for the plan to cut them into pieces with warm-ups; the two-kernel
    backward walks the same truncation."""
    inputs, do, dht = make_backward_inputs(seq_lens, 2, 8, True)
    fused = run_backward(inputs, do, dht, log_decay_threshold=threshold)
    two_kernels = run_backward(inputs, do, dht, fused_reverse=False, log_decay_threshold=threshold)
    assert_close_to_two_kernels(fused, two_kernels, seq_lens)


def unnormalised_inputs_and_rstds(lengths, heads):
    """The backward's inputs with q, k of norms from 0.1 to 10, and their L2 norm's r as backward takes them."""
    from flashqla.hopper.l2norm import l2_normalized

    inputs, do, dht = make_backward_inputs(lengths, *heads, True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for name in ("q", "k"):
        norms = torch.exp(torch.empty(inputs[name].shape[:3], device="cuda").uniform_(-2.3, 2.3, generator=gen))
        inputs[name] = (inputs[name].float() * norms[..., None]).to(torch.bfloat16).contiguous()
    return inputs, do, dht, {f"{name}_rstd": l2_normalized(inputs[name])[1] for name in ("q", "k")}


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("heads", [(16, 16), (2, 8)], ids=["16_16", "2_8"])
def test_fused_backward_with_the_l2_norm_matches_two_kernels(heads):
    """q, k unnormalised (norms from 0.1 to 10) with the norm's r: the walk folds r into its factors."""
    inputs, do, dht, rstds = unnormalised_inputs_and_rstds(RAGGED, heads)
    fused = run_backward(inputs, do, dht, **rstds)
    two_kernels = run_backward(inputs, do, dht, fused_reverse=False, **rstds)
    assert_close_to_two_kernels(fused, two_kernels, RAGGED)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("lengths", [RAGGED, [8192]], ids=["ragged", "1x8192"])
@pytest.mark.parametrize("heads", [(16, 16), (4, 4)], ids=["16_16", "4_4"])
def test_the_norms_backward_in_the_walk_matches_two_kernels(heads, lengths):
    """norm_in_fused_walk: dq, dk through the norm on chip (the first half of dq waits in shared memory for the
    row dot of both), on full chunks (stored by TMA) and partial ones (by the threads), against the two kernels,
    whose chunk gradients apply the norm's backward in their own epilogue at these layouts."""
    inputs, do, dht, rstds = unnormalised_inputs_and_rstds(lengths, heads)
    in_walk = run_backward(inputs, do, dht, norm_in_fused_walk=True, **rstds)
    two_kernels = run_backward(inputs, do, dht, fused_reverse=False, **rstds)
    assert_close_to_two_kernels(in_walk, two_kernels, lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_fused_backward_is_bitwise_deterministic(heads):
    inputs, do, dht = make_backward_inputs(RAGGED, *heads, True)
    first = run_backward(inputs, do, dht)
    second = run_backward(inputs, do, dht)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("num_qk_heads,with_rstds", [(2, True), (4, False)], ids=["grouped", "no_rstds"])
def test_the_norms_backward_in_the_walk_refuses_what_it_cannot_do(num_qk_heads, with_rstds):
    """Before anything is allocated or compiled (CPU): the norm's backward in the walk needs the norm's r and a
    q, k head for every value head."""
    from flashqla.hopper.backward_fused import fused_backward_grads

    q = torch.zeros(64, num_qk_heads, 128, dtype=torch.bfloat16)
    v = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    rstds = (torch.ones(64, num_qk_heads),) * 2 if with_rstds else None
    with pytest.raises(ValueError, match=r"l2norm_backward needs rstds and as many q, k heads as value heads"):
        fused_backward_grads(q, q, v, *[None] * 11, rstds=rstds, l2norm_backward=True)
