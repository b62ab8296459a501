"""The keep_products candidate (flashqla/hopper/candidates.py): the backward takes the forward's Ab
and P instead of recomputing them.

Run on an H200 with `pytest -m gpu -s` (tools/device_session.sh's `candidates` part). What decides:
the gradients are bitwise those of the recomputing backward for bf16 inputs (same kernels, same
inputs), within the float64 tolerance for float16 and through the public op under activation
checkpointing, and the timing test shows the backward faster. The memory cost is T * Hv * 256
bytes of saved activations per call.
"""
import pytest
import torch

from hopper_grid import (GRAD_NAMES, RAGGED, TOLERANCE, assert_close_to_reference, float64_gradients, make_inputs,
                         make_backward_inputs, on_hopper)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]
SCALE = 128 ** -0.5


def forward_then_backward(inputs, do, dht, keep: bool):
    from flashqla import hopper
    from flashqla.hopper.backward import backward

    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    _, _, products = hopper.forward(*args, SCALE, inputs["initial_state"], True, inputs["cu_seqlens"],
                                    return_products=True)
    return backward(*args, SCALE, inputs["initial_state"], inputs["cu_seqlens"], do, dht,
                    products=products if keep else None)


@pytest.mark.parametrize("lengths", [[4096], RAGGED, [32768]], ids=["1x4096", "ragged", "1x32768"])
@pytest.mark.parametrize("heads", [(16, 64), (16, 16), (2, 8)], ids=["16_64", "16_16", "2_8"])
def test_kept_products_give_bitwise_the_same_gradients(heads, lengths):
    inputs, do, dht = make_backward_inputs(lengths, *heads, True)
    kept = forward_then_backward(inputs, do, dht, keep=True)
    recomputed = forward_then_backward(inputs, do, dht, keep=False)
    for name, a, b in zip(GRAD_NAMES, kept, recomputed):
        assert torch.equal(a, b), name


def test_kept_float16_products_stay_within_tolerance():
    """float16 inputs give float16 products, which the backward converts to bf16."""
    inputs, do, dht = make_inputs(RAGGED, 4, 16, True, dtype=torch.float16, with_output_grads=True)
    assert_close_to_reference(forward_then_backward(inputs, do, dht, keep=True), float64_gradients(inputs, do, dht))


def test_public_op_with_kept_products_under_checkpointing():
    import flashqla
    from flashqla.hopper import candidates
    from flashqla.testing import relative_error
    from torch.utils.checkpoint import checkpoint

    inputs, do, dht = make_backward_inputs(RAGGED, 2, 8, True)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads(keep: bool):
        leaves = [inputs[n].clone().requires_grad_() for n in names]

        def op(q, k, v, g, beta, h0):
            return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=inputs["cu_seqlens"], backend="tilelang")

        with candidates.use(*(("keep_products",) if keep else ())):
            o, final_state = checkpoint(op, *leaves, use_reentrant=False)
        loss = (o.float() * do.float()).sum() + (final_state * dht).sum()
        return torch.autograd.grad(loss, leaves)

    kept, recomputed = grads(True), grads(False)
    for name, a, b in zip(names, kept, recomputed):
        assert relative_error(a, b) <= 1e-6, name
    reference = float64_gradients(inputs, do, dht)
    assert all(relative_error(a, r) <= TOLERANCE for a, r in zip(kept, reference))


@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_kept_products_backward_time(heads):
    """Prints do_bench medians of the backward with and without the kept products (run with -s)."""
    from triton.testing import do_bench

    inputs, do, dht = make_backward_inputs([32768], *heads, True)
    from flashqla import hopper
    from flashqla.hopper.backward import backward

    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    _, _, products = hopper.forward(*args, SCALE, inputs["initial_state"], True, inputs["cu_seqlens"],
                                    return_products=True)
    times = {}
    for name, kept in (("recomputed", None), ("kept", products)):
        times[name] = do_bench(lambda: backward(*args, SCALE, inputs["initial_state"], inputs["cu_seqlens"], do, dht,
                                                products=kept), warmup=10, rep=200, return_mode="median")
    print(f"\nbackward {heads[0]}/{heads[1]} 1x32768: recomputed {times['recomputed']:.3f} ms, "
          f"kept {times['kept']:.3f} ms")
    assert times["kept"] < times["recomputed"]
