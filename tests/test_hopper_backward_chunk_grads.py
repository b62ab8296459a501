"""Tests of the candidate chunk-gradient kernel (flashqla/hopper/backward_pipelined.py).

The candidate is selected by `backward(..., pipelined=True)`; the default stays the device-verified
backward_fused.py until one `pytest -m gpu -s tests/test_hopper_backward_pipelined.py` run on an
H200 passes and the printed timings show it faster (docs/kernel-notes.md says what decides).

CPU checks (need nvcc only): the kernel compiles for sm_90a to wgmma and TMA, and its generated
CUDA waits for every TMA load group before the first read and refills it only after the last one,
and no TMA-filled buffer shares shared memory with another buffer (the two races seen on the device
so far were of these kinds).
"""
import re
import shutil

import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (GRAD_NAMES, HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, assert_close_to_reference,
                         float64_gradients, make_backward_inputs, on_hopper, poison_allocator)

# Candidate against the current kernel on the same inputs: both round the same products to bf16,
# but sum in different orders (and dK's diag(beta) dL term goes through two products).
KERNEL_AGREEMENT = 1e-2
TMA_GROUPS = {"loads_a": ("q_s", "k_s", "inv_s", "do_s"), "loads_b": ("w_s", "s0_s", "ds_s")}
# Largest dynamic shared memory one H100/H200 CTA may use (227 KB), less 1 KB of static barriers.
SHARED_LIMIT_BYTES = 227 * 1024 - 1024

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the sm_90a kernels")
requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")


def test_chunk_bounds_of_ragged_batch():
    from flashqla.hopper.backward_pipelined import chunk_bounds
    from flashqla.hopper.chunk_plan import chunk_indices

    cu_seqlens = torch.tensor([0, 100, 100, 164, 165], dtype=torch.int32)  # 100, 0, 64, 1 tokens
    bounds = chunk_bounds(cu_seqlens, chunk_indices(cu_seqlens))
    assert bounds.dtype == torch.int32
    assert bounds.tolist() == [[0, 64], [64, 36], [100, 64], [164, 1]]


def test_backward_defaults_to_the_verified_kernel(monkeypatch):
    import inspect

    from flashqla.hopper import candidates
    from flashqla.hopper.backward import backward

    monkeypatch.delenv(candidates.ENV_VAR, raising=False)
    assert inspect.signature(backward).parameters["pipelined"].default is None  # None: ask candidates
    assert not candidates.enabled("pipelined_backward")


@pytest.fixture(scope="module")
def kernel_source():
    from flashqla.hopper.backward_pipelined import compile_pipelined_backward

    return compile_pipelined_backward().get_kernel_source()


@needs_nvcc
def test_compiles_to_wgmma_and_tma(kernel_source):
    assert "wgmma" in kernel_source and "tma_load" in kernel_source


@needs_nvcc
def test_load_groups_are_waited_before_reads_and_refilled_after_last_read(kernel_source):
    """Inside the task loop, for each mbarrier group: no read of its buffers before the wait, a
    wgmma wait and a block barrier between the last read and the refill, no read after it."""
    lines = kernel_source.splitlines()
    wait_at = {group: next(i for i, line in enumerate(lines) if f"{group}[0].wait(" in line) for group in TMA_GROUPS}
    loop_start = max(i for i, line in enumerate(lines[:min(wait_at.values())])
                     if line.lstrip().startswith("for (") and "num_workers" in line)
    for group, buffers in TMA_GROUPS.items():
        refills = [i for i, line in enumerate(lines) if i > loop_start and "tma_load(" in line
                   and any(f"*){name})" in line for name in buffers)]
        assert refills and all(f"{group}[0]" in lines[i] for i in refills), group
        refill_at = refills[0]
        uses = [i for i, line in enumerate(lines) if i > loop_start and "tma_load(" not in line
                and any(re.search(rf"\b{name}\b", line) for name in buffers)]
        assert uses, group
        assert min(uses) > wait_at[group], f"{group}: read at line {min(uses)} before its wait"
        assert max(uses) < refill_at, f"{group}: read at line {max(uses)} after its refill"
        between = lines[max(uses):refill_at]
        assert any("warpgroup_wait<0>" in line for line in between), group
        assert any("__syncthreads()" in line for line in between), group


@needs_nvcc
def test_tma_buffers_share_no_shared_memory(kernel_source):
    from tilelang import tvm

    from flashqla.hopper.backward_pipelined import TMA_BUFFERS, pipelined_backward_program

    sizes = {}

    def collect(node):
        for buffer in getattr(node, "alloc_buffers", None) or []:
            if buffer.scope().startswith("shared") and buffer.scope() != "shared.barrier":
                count = 1
                for extent in buffer.shape:
                    count *= int(extent)
                sizes[buffer.name] = count * tvm.DataType(buffer.dtype).bits // 8

    tvm.tirx.stmt_functor.post_order_visit(pipelined_backward_program().body, collect)
    offsets = {name: int(offset) for name, offset in
               re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", kernel_source)}
    assert set(TMA_BUFFERS) <= set(offsets)
    for name in TMA_BUFFERS:
        start, end = offsets[name], offsets[name] + sizes[name]
        for other, other_start in offsets.items():
            if other == name:
                continue
            # Buffers TileLang adds while lowering (reduction workspaces) have no known size here;
            # one starting before this buffer ends before it, since this buffer starts a region.
            other_end = other_start + sizes.get(other, 1)
            assert other_end <= start or other_start >= end, f"{other} overlaps {name}"
    top = max(offsets[name] + sizes.get(name, 1024) for name in offsets)
    assert top <= SHARED_LIMIT_BYTES, f"{top} bytes of dynamic shared memory"


def kernel_inputs(seq_lens, num_qk_heads, num_v_heads, seed=0):
    """Inputs of the chunk-gradient kernels built by the same stages as backward.py (states and
    state gradients random: both kernels compute the same function of them)."""
    from flashqla.hopper.chunk_plan import chunk_indices
    from flashqla.hopper.cumsum import chunk_local_cumsum
    from flashqla.hopper.inverse import gate_free_inverse

    inputs, do, _ = make_backward_inputs(seq_lens, num_qk_heads, num_v_heads, False, seed=seed)
    total = sum(seq_lens)
    cu_seqlens = inputs["cu_seqlens"]
    chunk_index = chunk_indices(cu_seqlens)
    q = inputs["q"].view(total, num_qk_heads, 128)
    k = inputs["k"].view(total, num_qk_heads, 128)
    g = inputs["g"].view(total, num_v_heads)
    beta = inputs["beta"].view(total, num_v_heads).contiguous()
    gamma = chunk_local_cumsum(g.unsqueeze(0), cu_seqlens, chunk_index=chunk_index).view(total, num_v_heads)
    inverse = gate_free_inverse(k.unsqueeze(0), beta.unsqueeze(0), cu_seqlens, chunk_index=chunk_index)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    states = torch.randn(chunk_index.shape[0], num_v_heads, 128, 128, generator=gen, device="cuda")
    state_grads = torch.randn(chunk_index.shape[0], num_v_heads, 128, 128, generator=gen, device="cuda")
    return dict(q=q, k=k, v=inputs["v"].view(total, num_v_heads, 128), gamma=gamma.contiguous(), beta=beta,
                inverse=inverse.view(total, num_v_heads, -1), chunk_states=states.to(torch.bfloat16),
                chunk_state_grads=state_grads.to(torch.bfloat16), do=do.view(total, num_v_heads, 128),
                scale=128 ** -0.5, cu_seqlens=cu_seqlens, chunk_index=chunk_index)


def run_kernel(kernel, args, **options):
    poison_allocator()
    return kernel(**args, **options)


def run_full_backward(inputs, do, dht, pipelined):
    from flashqla.hopper.backward import backward

    poison_allocator()
    return backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], 128 ** -0.5,
                    inputs["initial_state"], inputs["cu_seqlens"], do, dht, pipelined=pipelined)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_pipelined_backward_matches_reference_and_current(heads, lengths, with_initial_state):
    """The whole grid: float64 reference within the budget, and close to the current kernel."""
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, with_initial_state)
    candidate = run_full_backward(inputs, do, dht, pipelined=True)
    current = run_full_backward(inputs, do, dht, pipelined=False)
    assert_close_to_reference(candidate, float64_gradients(inputs, do, dht))
    agreement = {name: relative_error(a, b) for name, a, b in zip(GRAD_NAMES, candidate, current)}
    assert all(err <= KERNEL_AGREEMENT for err in agreement.values()), agreement


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("lengths", ["1x4096", "ragged"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_pipelined_backward_strong_decay(heads, lengths):
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, True, strong_decay=True)
    assert_close_to_reference(run_full_backward(inputs, do, dht, pipelined=True), float64_gradients(inputs, do, dht))


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("num_workers", [1, 7, None], ids=["1_cta", "7_ctas", "sm_count"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_pipelined_kernel_matches_current_kernel(heads, num_workers):
    """Kernel against kernel on the same inputs (ragged: partial chunks, an empty and a one-token
    sequence), with one CTA walking every task, an uneven split, and one CTA per SM."""
    from flashqla.hopper.backward_fused import fused_backward
    from flashqla.hopper.backward_pipelined import pipelined_backward

    args = kernel_inputs(RAGGED, *heads)
    current = run_kernel(fused_backward, args)
    candidate = run_kernel(pipelined_backward, args, num_workers=num_workers)
    names = ("dq_head", "dk_head", "dv", "dg", "dbeta")
    agreement = {name: relative_error(a, b) for name, a, b in zip(names, candidate, current)}
    assert all(err <= KERNEL_AGREEMENT for err in agreement.values()), agreement


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_pipelined_backward_is_bitwise_deterministic(heads):
    inputs, do, dht = make_backward_inputs(RAGGED, *heads, True)
    first = run_full_backward(inputs, do, dht, pipelined=True)
    second = run_full_backward(inputs, do, dht, pipelined=True)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


SPEED_SHAPES = [((16, 64), [32768]), ((2, 8), [32768]), ((2, 8), [131072]), ((16, 64), [28672, 4096])]


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads,lengths", SPEED_SHAPES,
                         ids=[f"{h[0]}_{h[1]}-{'+'.join(map(str, n))}" for h, n in SPEED_SHAPES])
def test_pipelined_kernel_speed(heads, lengths):
    """Prints both chunk-gradient kernels' do_bench medians on the same inputs (run with -s); the
    default should switch when the candidate is faster on every shape and all tests here pass."""
    from triton.testing import do_bench

    from flashqla.hopper.backward_fused import fused_backward
    from flashqla.hopper.backward_pipelined import pipelined_backward

    args = kernel_inputs(lengths, *heads)
    current = fused_backward(**args)
    candidate = pipelined_backward(**args)
    names = ("dq_head", "dk_head", "dv", "dg", "dbeta")
    agreement = {name: relative_error(a, b) for name, a, b in zip(names, candidate, current)}
    assert all(err <= KERNEL_AGREEMENT for err in agreement.values()), agreement
    current_ms = do_bench(lambda: fused_backward(**args), warmup=25, rep=200, return_mode="median")
    candidate_ms = do_bench(lambda: pipelined_backward(**args), warmup=25, rep=200, return_mode="median")
    shape = f"{heads[0]}/{heads[1]} {'+'.join(map(str, lengths))}"
    print(f"\nchunk-gradient kernel {shape}: current {current_ms:.3f} ms, candidate {candidate_ms:.3f} ms, "
          f"current/candidate {current_ms / candidate_ms:.2f}")
    assert candidate_ms > 0 and current_ms > 0
