"""Tests of the TileLang backward (flashqla/hopper/backward.py).

GPU tests compare every gradient with autograd through the float64 chunked reference (itself
checked against the token recurrence in tests/flashqla/test_reference.py) over the grid of
tests/flashqla/hopper_grid.py.
"""
import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (GRAD_NAMES, HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, TOLERANCE, assert_close_to_reference,
                         float64_gradients, make_backward_inputs, on_hopper, poison_allocator)


def run_backward(inputs, do, dht):
    from flashqla.hopper.backward import backward

    poison_allocator()
    scale = 128 ** -0.5
    return backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale,
                    inputs["initial_state"], inputs["cu_seqlens"], do, dht)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_backward_matches_float64_reference(heads, lengths, with_initial_state):
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, with_initial_state)
    ours = run_backward(inputs, do, dht)
    assert tuple(ours[0].shape) == tuple(inputs["q"].shape) and ours[0].dtype == torch.bfloat16
    assert ours[3].dtype == torch.float32 and ours[5].dtype == torch.float32
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht), LENGTHS[lengths])


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("lengths", ["1x4096", "ragged"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_backward_strong_decay(heads, lengths):
    """A quarter of the heads with g = 0, a quarter with g down to -20 per token."""
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, True, strong_decay=True)
    assert_close_to_reference(run_backward(inputs, do, dht), float64_gradients(inputs, do, dht), LENGTHS[lengths])


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_backward_is_bitwise_deterministic(heads):
    inputs, do, dht = make_backward_inputs(RAGGED, *heads, True)
    first = run_backward(inputs, do, dht)
    second = run_backward(inputs, do, dht)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("keep", [True, "inverse", False], ids=["keep_all", "keep_inverse", "keep_nothing"])
@pytest.mark.parametrize("heads", [(2, 8), (4, 4)], ids=["2_8", "4_4"])
def test_autograd_end_to_end_with_checkpointing_and_views(heads, keep):
    """chunk_gated_delta_rule(backend="tilelang") under activation checkpointing (forward run
    twice), with non-contiguous q/k/v views and in-op L2 normalisation (q, k at 3x unit norm; the
    norm's kernel sums each head group at 2/8), against the reference,
    for each of what the forward keeps (the backward rewalks the chunks, or runs the forward again)."""
    import flashqla
    from torch.utils.checkpoint import checkpoint

    num_qk_heads = heads[0]
    inputs, do, dht = make_backward_inputs(RAGGED, *heads, True)
    # Non-contiguous views: heads interleaved in a wider tensor.
    wide = torch.cat([inputs["q"], inputs["k"]], dim=2)
    leaves = {
        "qk": (wide * 3).detach().requires_grad_(),
        "v": inputs["v"].clone().requires_grad_(),
        "g": inputs["g"].clone().requires_grad_(),
        "beta": inputs["beta"].clone().requires_grad_(),
        "h0": inputs["initial_state"].clone().requires_grad_(),
    }

    def loss_of(backend, leaves, use_checkpoint):
        qk = leaves["qk"] if backend == "tilelang" else leaves["qk"].double()
        q, k = qk[:, :, :num_qk_heads], qk[:, :, num_qk_heads:]
        cast = (lambda x: x) if backend == "tilelang" else (lambda x: x.double())
        options = dict(keep_for_backward=keep) if backend == "tilelang" else {}

        def op(q, k, v, g, beta, h0):
            return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, cu_seqlens=inputs["cu_seqlens"],
                                                   backend=backend, **options)

        args = (q, k, cast(leaves["v"]), cast(leaves["g"]), cast(leaves["beta"]), cast(leaves["h0"]))
        o, final_state = checkpoint(op, *args, use_reentrant=False) if use_checkpoint else op(*args)
        return (o.double() * do.double()).sum() + (final_state.double() * dht.double()).sum()

    ours = torch.autograd.grad(loss_of("tilelang", leaves, True), list(leaves.values()))
    ref = torch.autograd.grad(loss_of("torch", leaves, False), list(leaves.values()))
    errors = {name: relative_error(a, b) for name, a, b in zip(leaves, ours, ref)}
    assert all(err <= TOLERANCE for err in errors.values()), errors


def test_backward_rejects_other_head_dims():
    from flashqla.hopper.backward import backward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16)
    g = beta = torch.zeros(1, 64, 4)
    with pytest.raises(ValueError, match="K = V = 128, got K=64, V=64"):
        backward(q, q, v, g, beta, 0.125, None, None, v, None)
