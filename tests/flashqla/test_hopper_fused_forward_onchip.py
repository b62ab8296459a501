"""GPU tests of the candidate forward walk that builds Ab and P on chip (flashqla/hopper/fused_forward_onchip.py,
`hopper.forward(..., products_on_chip=True)`), against the float64 references and against the current forward.

Needs an SM90 GPU: skipped elsewhere. Each kernel call runs under a thread timeout in the device
script: a wrong mbarrier parity hangs instead of failing.
"""
import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, TOLERANCE, assert_close_to_reference,
                         float64_gradients, float64_reference, make_backward_inputs, make_inputs, on_hopper,
                         poison_allocator)

pytestmark = pytest.mark.gpu

if not on_hopper:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from flashqla.hopper.backward import backward  # noqa: E402  (imports tilelang; only where the kernels can run)
from flashqla.hopper.forward import forward  # noqa: E402


def run(inputs, poison=True, **kwargs):
    if poison:
        poison_allocator()
    return forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None, inputs["initial_state"],
                   True, inputs["cu_seqlens"], **kwargs)


def check_against(inputs, o, final_state, ref=None):
    """o and the final state finite and within TOLERANCE of float64; returns the two errors."""
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), "NaN/Inf in o (unwritten rows?)"
    assert torch.isfinite(final_state).all(), "NaN/Inf in the final state"
    ref_o, ref_state = float64_reference(inputs) if ref is None else ref
    errors = relative_error(o, ref_o), relative_error(final_state, ref_state)
    assert errors[0] <= TOLERANCE and errors[1] <= TOLERANCE, errors
    return errors


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_onchip_forward_matches_float64_and_the_current_forward(heads, lengths, with_initial_state):
    inputs = make_inputs(LENGTHS[lengths], *heads, with_initial_state, seed=heads[1] * 10 + list(LENGTHS).index(lengths))
    ref = float64_reference(inputs)
    ours = check_against(inputs, *run(inputs, products_on_chip=True), ref=ref)
    current = check_against(inputs, *run(inputs), ref=ref)
    print(f"\n{heads} {lengths} h0={with_initial_state}: o {ours[0]:.2e} (current {current[0]:.2e}), "
          f"final state {ours[1]:.2e} (current {current[1]:.2e})")
    assert ours[0] <= 1.5 * current[0] + 1e-3 and ours[1] <= 1.5 * current[1] + 1e-3


@pytest.mark.parametrize("heads", [(16, 64), (16, 16), (2, 8)], ids=["16_64", "16_16", "2_8"])
def test_onchip_forward_with_128_wide_value_blocks(heads):
    inputs = make_inputs([32768], *heads, with_initial_state=True, seed=3)
    check_against(inputs, *run(inputs, products_on_chip=True, max_value_block=128))


@pytest.mark.parametrize("heads", [(16, 64), (2, 8), (4, 16)], ids=["16_64", "2_8", "4_16"])
def test_onchip_kept_tensors_match_the_current_forward(heads):
    """What the walk hands the backward: gamma and A~ bitwise, Ab and P and the chunk states within
    bf16 rounding of what the products kernel and the current walk store."""
    inputs = make_inputs(RAGGED + [4096], *heads, with_initial_state=True, seed=5)
    _, _, kept = run(inputs, products_on_chip=True, keep_for_backward=True)
    _, _, current = run(inputs, keep_for_backward=True)
    torch.cuda.synchronize()
    assert torch.equal(kept.gamma, current.gamma)
    assert torch.equal(kept.inverse, current.inverse)
    for name in ("gated_inverse", "scores", "chunk_states"):
        mine, theirs = getattr(kept, name), getattr(current, name)
        assert torch.isfinite(mine).all(), name
        err = relative_error(mine, theirs)
        assert err <= 1e-2, f"{name}: {err:.3e}"


@pytest.mark.parametrize("keep_chunk_states", [True, False], ids=["states", "products"])
@pytest.mark.parametrize("heads", [(16, 32), (2, 8)], ids=["16_32", "2_8"])
def test_backward_from_onchip_kept_tensors_matches_float64(heads, keep_chunk_states):
    inputs, do, dht = make_backward_inputs(RAGGED + [4096], *heads, with_initial_state=True, seed=9)
    _, _, kept = run(inputs, products_on_chip=True, keep_for_backward=True, keep_chunk_states=keep_chunk_states)
    poison_allocator()
    grads = backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], 128 ** -0.5,
                     inputs["initial_state"], inputs["cu_seqlens"], do, dht, kept=kept)
    torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for g in grads)
    assert_close_to_reference(grads, float64_gradients(inputs, do, dht))


@pytest.mark.parametrize("lengths", [[32768], [28672, 4096], [8192] * 4], ids=["1x32768", "28672+4096", "8192x4"])
def test_onchip_split_sequences_exact_and_truncated(lengths):
    inputs = make_inputs(lengths, 2, 8, with_initial_state=True, seed=21)
    ref = float64_reference(inputs)
    exact = run(inputs, products_on_chip=True, log_decay_threshold=float("-inf"))
    check_against(inputs, *exact, ref=ref)
    check_against(inputs, *run(inputs, products_on_chip=True, log_decay_threshold=-10.0), ref=ref)
    current = run(inputs, log_decay_threshold=float("-inf"))
    # Exact warm-ups: the same o and final state as the current walk, to bf16 rounding.
    assert relative_error(exact[0], current[0]) <= 1e-2 and relative_error(exact[1], current[1]) <= 1e-2


@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_onchip_forward_is_bitwise_deterministic(heads):
    inputs = make_inputs(RAGGED + [4096], *heads, with_initial_state=True, seed=7)
    first = run(inputs, products_on_chip=True, keep_for_backward=True)
    second = run(inputs, products_on_chip=True, keep_for_backward=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


def test_onchip_forward_other_dtypes():
    """float16 q/k/v; bf16 beta (the model's); a group of 16 value heads per qk head (A~ per value head)."""
    inputs = make_inputs([777, 1536], 4, 16, with_initial_state=True, dtype=torch.float16, seed=3)
    o, final_state = run(inputs, products_on_chip=True)
    assert o.dtype == torch.float16
    check_against(inputs, o, final_state)
    inputs = make_inputs([777, 1536], 4, 16, with_initial_state=True, seed=4)
    inputs["beta"] = inputs["beta"].to(torch.bfloat16)
    check_against(inputs, *run(inputs, products_on_chip=True))
    inputs = make_inputs([1000, 129], 1, 16, with_initial_state=False, seed=6)
    check_against(inputs, *run(inputs, products_on_chip=True))


def test_onchip_forward_time_against_the_current_forward():
    """Prints do_bench medians (no autograd) of both forwards on the bench's inputs (anchors' gates:
    short warm-ups); fails where the candidate is slower."""
    from triton.testing import do_bench

    from flashqla.bench import make_inputs as bench_inputs

    slower = []
    for heads, lengths in (((16, 64), [32768]), ((16, 16), [131072]), ((2, 8), [131072])):
        inputs = bench_inputs(heads, lengths)
        host = inputs["cu_seqlens_cpu"].tolist()
        with torch.no_grad():
            times = {name: do_bench(lambda: run(inputs, poison=False, cu_seqlens_host=host, **kwargs), rep=200,
                                    return_mode="median")
                     for name, kwargs in (("current", {}), ("on chip", dict(products_on_chip=True)),
                                          ("on chip, BV<=128", dict(products_on_chip=True, max_value_block=128)))}
        print(f"\n{heads} {lengths}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()))
        if times["on chip"] > times["current"]:
            slower.append((heads, lengths, times))
    assert not slower, slower
