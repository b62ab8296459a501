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
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht))


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("lengths", ["1x4096", "ragged"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_backward_strong_decay(heads, lengths):
    """A quarter of the heads with g = 0, a quarter with g down to -20 per token."""
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, True, strong_decay=True)
    assert_close_to_reference(run_backward(inputs, do, dht), float64_gradients(inputs, do, dht))


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
def test_autograd_end_to_end_with_checkpointing_and_views():
    """chunk_gated_delta_rule(backend="tilelang") under activation checkpointing (forward run
    twice), with non-contiguous q/k/v views and in-op L2 normalisation, against the reference."""
    import flashqla
    from torch.utils.checkpoint import checkpoint

    inputs, do, dht = make_backward_inputs(RAGGED, 2, 8, True)
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
        q, k = qk[:, :, :2], qk[:, :, 2:]
        cast = (lambda x: x) if backend == "tilelang" else (lambda x: x.double())

        def op(q, k, v, g, beta, h0):
            return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, cu_seqlens=inputs["cu_seqlens"],
                                                   backend=backend)

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


def test_backward_kernels_use_hopper_instructions():
    """Both backward kernels compile for sm_90a to wgmma and load their tiles through TMA
    (CPU-only: needs nvcc, not a GPU)."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to compile the sm_90a kernels")
    from flashqla.hopper.backward_chunk_grads import compile_chunk_grads
    from flashqla.hopper.backward_state_grads import compile_state_grads

    sources = {"state grads": compile_state_grads(32).get_kernel_source(),
               "chunk grads": compile_chunk_grads().get_kernel_source()}
    for name, source in sources.items():
        assert "wgmma" in source and "tma_load" in source, name


def test_async_state_grads_candidate_refills_a_stage_only_after_its_products():
    """The state-gradient walk's candidate (`async_products=True`) in its generated CUDA: see
    double_buffer_hazards (CPU-only: needs nvcc, not a GPU)."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to compile the sm_90a kernels")
    from flashqla.hopper.backward_state_grads import compile_state_grads

    lines = compile_state_grads(64, True, True).get_kernel_source().splitlines()
    assert double_buffer_hazards(lines) == []


def double_buffer_hazards(lines: list[str]) -> list[str]:
    """What breaks the candidate walk's double buffer in its CUDA source, around the loop over pairs
    of chunks (its body read twice, so one pass's reads precede the next pass's refills): a stage
    read between its refill and the wait on its barrier; a refill not after a `wait_wgmma<0>` that
    follows the last product reading the stage, or not after a block barrier that follows its last
    read; a barrier not waited once a pass with parity pair % 2."""
    import re

    stages = {"loads0": ("q_s", "k_s", "do_s", "ab_s", "pm_s"), "loads1": ("q_s1", "k_s1", "do_s1", "ab_s1", "pm_s1")}
    loop_start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for (int pair"))
    depth = 0
    for loop_end in range(loop_start, len(lines)):
        depth += lines[loop_end].count("{") - lines[loop_end].count("}")
        if depth == 0:
            break
    body = lines[loop_start + 1:loop_end]
    thrice = body * 3
    problems = []
    for barrier, buffers in stages.items():
        def reads(line):
            return "tma_load(" not in line and any(re.search(rf"\b{name}\b", line) for name in buffers)

        waits = [line for line in body if f"{barrier}[0].wait(" in line]
        if len(waits) != 1 or f"{barrier}[0].wait((pair & 1))" not in waits[0]:
            problems.append(f"{barrier}: not one wait a pass with parity pair % 2: {waits}")
        refills = [i for i, line in enumerate(thrice) if len(body) <= i < 2 * len(body) and "tma_load(" in line
                   and any(f"*){name})" in line for name in buffers)]
        if not refills or not all(f"{barrier}[0]" in thrice[i] for i in refills):
            problems.append(f"{barrier}: its stage's refills are not on it")
        for refill in refills:
            read_before = [i for i in range(refill) if reads(thrice[i])]
            last_product = max((i for i in read_before if "wgmma_descriptor" in thrice[i]), default=read_before[-1])
            if not any("wait_wgmma<0>" in line for line in thrice[last_product:refill]):
                problems.append(f"{barrier}: refill at loop line {refill % len(body)} while a product may read")
            if not any("__syncthreads()" in line for line in thrice[read_before[-1]:refill]):
                problems.append(f"{barrier}: refill at loop line {refill % len(body)} before every thread's last read")
            next_wait = next(i for i in range(refill, len(thrice)) if f"{barrier}[0].wait(" in thrice[i])
            problems += [f"{barrier}: read at loop line {i % len(body)} before its refill landed"
                         for i in range(refill + 1, next_wait) if reads(thrice[i])]
    return problems
