"""The forward keeps gamma, A~ and the state entering every chunk (forward.KeptForward) and the backward
recomputes none of them (the public op's default); with keep_for_backward="inverse" all but the chunk states,
which the backward walks the chunks again for; with False nothing (the backward runs the forward again).

Checked: the kept tensors agree with float64 (gamma, A~) and with the state-only walk of chunk_states.py,
and the gradients stay within the float64 tolerance on the grid (ragged, split sequences, strong decay,
a group of 16 value heads per qk head, float16, the public op under both kinds of
checkpointing).
How much faster it is: `python -m flashqla.bench --compare keep_forward`.
"""
import pytest
import torch

from hopper_grid import (GRAD_NAMES, RAGGED, TOLERANCE, assert_close_to_reference, float64_gradients, make_inputs,
                         make_backward_inputs, on_hopper, poison_allocator)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]
SCALE = 128 ** -0.5
ARGS = ("q", "k", "v", "g", "beta")


def forward_then_backward(inputs, do, dht, keep_chunk_states: bool = True):
    """Gradients through forward(keep_for_backward=True) and the backward that takes them,
    with NaN in every free block beforehand so that anything left unwritten shows."""
    from flashqla.hopper.backward import backward
    from flashqla.hopper.forward import forward

    args = [inputs[n] for n in ARGS]
    poison_allocator()
    _, _, kept = forward(*args, SCALE, inputs["initial_state"], True, inputs["cu_seqlens"],
                         keep_for_backward=True, keep_chunk_states=keep_chunk_states)
    assert (kept.chunk_states is not None) == keep_chunk_states
    return backward(*args, SCALE, inputs["initial_state"], inputs["cu_seqlens"], do, dht, kept=kept)


@pytest.mark.parametrize("lengths", [[4096], RAGGED, [32768], [28672, 4096]],
                         ids=["1x4096", "ragged", "1x32768", "28672+4096"])
@pytest.mark.parametrize("heads", [(16, 64), (16, 16), (2, 8), (1, 16)], ids=["16_64", "16_16", "2_8", "1_16"])
def test_kept_forward_gradients_match_float64(heads, lengths):
    """2/8 splits its sequences into pieces (truncated warm-ups); 1/16 is a group of 16 value heads."""
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    kept = forward_then_backward(inputs, do, dht)
    for name, grad in zip(GRAD_NAMES, kept):
        assert torch.isfinite(grad).all(), name
    assert_close_to_reference(kept, float64_gradients(inputs, do, dht), lengths)


@pytest.mark.parametrize("heads", [(16, 64), (2, 8), (1, 16)], ids=["16_64", "2_8", "1_16"])
def test_kept_tensors_match_float64_and_the_state_only_walk(heads):
    """gamma within float32 rounding of float64; A~ (the inverse kernel's) within bf16 rounding of float64; the
    chunk states within tolerance of chunk_states.py's."""
    from flashqla.hopper.chunk_states import chunk_states
    from flashqla.hopper.forward import forward
    from flashqla.testing import relative_error
    from hopper_grid import assert_gamma_matches_float64, float64_products

    inputs = make_inputs(RAGGED + [8192], *heads, True, seed=3)
    poison_allocator()
    _, _, kept = forward(*(inputs[n] for n in ARGS), SCALE, inputs["initial_state"], True,
                         inputs["cu_seqlens"], keep_for_backward=True)
    cu = inputs["cu_seqlens"]
    assert_gamma_matches_float64(kept.gamma, inputs["g"], cu)
    exact = float64_products(inputs, SCALE)[0]
    assert torch.isfinite(kept.inverse).all(), "A~: NaN/Inf (unwritten rows?)"
    assert relative_error(kept.inverse, exact) <= 1e-2, relative_error(kept.inverse, exact)
    states, _, _ = chunk_states(inputs["k"][0], inputs["v"][0], kept.gamma, inputs["beta"][0],
                                kept.inverse.to(torch.bfloat16), inputs["initial_state"], cu)
    assert torch.isfinite(kept.chunk_states).all()
    assert relative_error(kept.chunk_states, states) <= 1e-2


@pytest.mark.parametrize("lengths", [RAGGED, [28672, 4096]], ids=["ragged", "28672+4096"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8), (1, 16)], ids=["16_64", "2_8", "1_16"])
def test_kept_products_without_states_give_bitwise_the_kept_gradients(heads, lengths):
    """keep_for_backward="inverse": the backward walks the chunks again for the states, the same
    kernel on the same inputs and plan (pieces and warm-ups included) as the forward's walk, so the
    gradients are those of keeping everything, to the bit."""
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    with_states = forward_then_backward(inputs, do, dht)
    rewalked = forward_then_backward(inputs, do, dht, keep_chunk_states=False)
    for name, a, b in zip(GRAD_NAMES, with_states, rewalked):
        assert torch.isfinite(b).all(), name
        assert torch.equal(a, b), name


def test_kept_float16_tensors_stay_within_tolerance():
    """float16 inputs keep float16 tensors, which the backward converts to bf16."""
    inputs, do, dht = make_inputs(RAGGED, 4, 16, True, dtype=torch.float16, with_output_grads=True)
    assert_close_to_reference(forward_then_backward(inputs, do, dht), float64_gradients(inputs, do, dht))


def test_kept_forward_is_bitwise_deterministic():
    inputs, do, dht = make_backward_inputs(RAGGED + [8192], 16, 64, True)
    first = forward_then_backward(inputs, do, dht)
    second = forward_then_backward(inputs, do, dht)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


def test_public_op_with_kept_forward_under_checkpointing(monkeypatch):
    """Both kinds of checkpoint: the gradients match the recomputing op's and float64, and the backward
    receives what the op was asked to keep (all, the products without the chunk states, or nothing)."""
    import flashqla
    from flashqla.hopper import backward as backward_module
    from flashqla.testing import relative_error
    from torch.utils.checkpoint import checkpoint

    received = []
    original_backward = backward_module.backward

    def spying_backward(*args, kept=None, **kwargs):
        received.append("nothing" if kept is None else "all" if kept.chunk_states is not None else "inverse")
        return original_backward(*args, kept=kept, **kwargs)

    monkeypatch.setattr(backward_module, "backward", spying_backward)  # autograd.py looks it up per call
    inputs, do, dht = make_backward_inputs(RAGGED, 2, 8, True)
    names = ARGS + ("initial_state",)

    def grads(keep, reentrant: bool):
        leaves = [inputs[n].clone().requires_grad_() for n in names]

        def op(q, k, v, g, beta, h0):
            return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=inputs["cu_seqlens"], backend="tilelang",
                                                   keep_for_backward=keep)

        o, final_state = checkpoint(op, *leaves, use_reentrant=reentrant)
        loss = (o.float() * do.float()).sum() + (final_state * dht).sum()
        loss.backward()  # a reentrant checkpoint refuses torch.autograd.grad
        return [leaf.grad for leaf in leaves]

    recomputed = grads(False, False)
    assert received == ["nothing"]
    reference = float64_gradients(inputs, do, dht)
    for keep in (True, "inverse"):
        for reentrant in (False, True):
            received.clear()
            kept = grads(keep, reentrant)
            assert received == ["all" if keep is True else "inverse"], (keep, reentrant)
            for name, a, b in zip(names, kept, recomputed):
                assert relative_error(a, b) <= 1e-2, (keep, reentrant, name)
            assert all(relative_error(a, r) <= TOLERANCE for a, r in zip(kept, reference))
