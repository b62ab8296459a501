"""Kernel-level tests of the chunk-gradient kernel (flashqla/hopper/backward_chunk_grads.py) and of
its candidate with overlapping products (backward_chunk_grads_overlap.py).

Its gradients against the float64 reference (the whole grid, strong decay, bitwise determinism)
are checked through `backward` in tests/flashqla/test_hopper_backward.py; here, what only the kernel shows.

CPU checks (need nvcc only): its generated CUDA waits for every TMA load group before the first
read and refills it only after the last one, and no TMA-filled buffer shares shared memory with
another buffer (the two races seen on the device while it was written were of these kinds).
Both kernels get these. GPU: the number of persistent CTAs does not change the result; the
candidate gives the kernel's gradients (dq, dk, dv within 1e-3, dg and dbeta within 1e-4, relative
L2 over the tensor; 10x that per (sequence, head)) on ragged lengths and one 8192-token sequence,
group sizes 4 and 1, bitwise deterministic, with NaN-poisoned memory.
"""
import re
import shutil

import pytest
import torch

from hopper_grid import RAGGED, make_backward_inputs, on_hopper, poison_allocator, sequence_head_errors

TMA_GROUPS = {"loads_a": ("q_s", "k_s", "inv_s", "do_s"), "loads_b": ("w_s", "s0_s", "ds_s")}
# Largest dynamic shared memory one H100/H200 CTA may use (227 KB), less 1 KB of static barriers.
SHARED_LIMIT_BYTES = 227 * 1024 - 1024
OUTPUT_NAMES = ("dq_head", "dk_head", "dv", "dg", "dbeta")

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the sm_90a kernels")
requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")


def test_chunk_bounds_of_ragged_batch():
    from flashqla.hopper.backward_chunk_grads import chunk_bounds
    from flashqla.hopper.chunk_plan import chunk_indices

    cu_seqlens = torch.tensor([0, 100, 100, 164, 165], dtype=torch.int32)  # 100, 0, 64, 1 tokens
    bounds = chunk_bounds(cu_seqlens, chunk_indices(cu_seqlens))
    assert bounds.dtype == torch.int32
    assert bounds.tolist() == [[0, 64], [64, 36], [100, 64], [164, 1]]


def _kernels():
    """name -> (program builder, compile function) of the kernel and its candidate."""
    from flashqla.hopper import backward_chunk_grads, backward_chunk_grads_overlap

    return {"kernel": (backward_chunk_grads.chunk_grads_program, backward_chunk_grads.compile_chunk_grads),
            "overlap": (backward_chunk_grads_overlap.overlap_program,
                        backward_chunk_grads_overlap.compile_chunk_grads_overlap)}


@pytest.fixture(scope="module", params=["kernel", "overlap"])
def kernel_name(request):
    return request.param


@pytest.fixture(scope="module")
def kernel_source(kernel_name):
    return _kernels()[kernel_name][1]().get_kernel_source()


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
        # T.gemm waits for its wgmma (warpgroup_wait); the candidate's T.wgmma_gemm by T.wait_wgmma
        assert any("warpgroup_wait<0>" in line or "wait_wgmma<0>" in line for line in between), group
        assert any("__syncthreads()" in line for line in between), group


@needs_nvcc
def test_tma_buffers_share_no_shared_memory(kernel_name, kernel_source):
    from flashqla.hopper.backward_chunk_grads import TMA_BUFFERS

    assert_tma_buffers_alone(_kernels()[kernel_name][0](), kernel_source, TMA_BUFFERS)


def assert_tma_buffers_alone(program, kernel_source, tma_buffers):
    """No buffer TMA fills shares a byte of shared memory with another buffer, and all of them fit."""
    from tilelang import tvm

    sizes = {}

    def collect(node):
        for buffer in getattr(node, "alloc_buffers", None) or []:
            if buffer.scope().startswith("shared") and buffer.scope() != "shared.barrier":
                count = 1
                for extent in buffer.shape:
                    count *= int(extent)
                sizes[buffer.name] = count * tvm.DataType(buffer.dtype).bits // 8

    tvm.tirx.stmt_functor.post_order_visit(program.body, collect)
    offsets = {name: int(offset) for name, offset in
               re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", kernel_source)}
    assert set(tma_buffers) <= set(offsets)
    for name in tma_buffers:
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
    """Inputs of the chunk-gradient kernel for the backward grid's op inputs (states and state
    gradients random: the runs compared see the same ones)."""
    from flashqla.testing import chunk_gradient_arguments

    inputs, do, _ = make_backward_inputs(seq_lens, num_qk_heads, num_v_heads, False, seed=seed)
    total = sum(seq_lens)
    return chunk_gradient_arguments(
        inputs["q"].view(total, num_qk_heads, 128), inputs["k"].view(total, num_qk_heads, 128),
        inputs["v"].view(total, num_v_heads, 128), inputs["g"].view(total, num_v_heads),
        inputs["beta"].view(total, num_v_heads), do.view(total, num_v_heads, 128), inputs["cu_seqlens"],
        seed=seed + 1)


def run_kernel(kernel, args, **options):
    poison_allocator()
    return kernel(**args, **options)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("num_workers", [1, 7], ids=["1_cta", "7_ctas"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_worker_count_does_not_change_the_gradients(heads, num_workers):
    """A task runs the same code on the same tiles whichever CTA takes it, so one CTA walking every
    task (every refill and barrier parity through one loop) and an uneven split give bitwise the
    gradients of one CTA per SM. Ragged lengths: partial chunks, an empty and a one-token sequence."""
    from flashqla.hopper.backward_chunk_grads import chunk_gradients

    args = kernel_inputs(RAGGED, *heads)
    per_sm = run_kernel(chunk_gradients, args)
    walked = run_kernel(chunk_gradients, args, num_workers=num_workers)
    for name, a, b in zip(OUTPUT_NAMES, walked, per_sm):
        assert torch.equal(a, b), name


CANDIDATE_BOUNDS = {"dq_head": 1e-3, "dk_head": 1e-3, "dv": 1e-3, "dg": 1e-4, "dbeta": 1e-4}


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("num_workers", [None, 1], ids=["per_sm", "1_cta"])
@pytest.mark.parametrize("lengths", [RAGGED, [8192]], ids=["ragged", "1x8192"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8), (16, 16)], ids=["16_64", "2_8", "16_16"])
def test_overlap_candidate_gives_the_kernels_gradients(heads, lengths, num_workers):
    from flashqla.hopper.backward_chunk_grads import chunk_gradients
    from flashqla.hopper.backward_chunk_grads_overlap import compile_chunk_grads_overlap
    from flashqla.testing import relative_error

    if num_workers == 1 and lengths != RAGGED:
        pytest.skip("one CTA over 8192 tokens takes long; the ragged batch walks every refill already")
    args = kernel_inputs(lengths, *heads)
    verified = run_kernel(chunk_gradients, args)
    candidate = run_kernel(chunk_gradients, args, compiled=compile_chunk_grads_overlap(), num_workers=num_workers)
    report = []
    for name, a, b in zip(OUTPUT_NAMES, verified, candidate):
        assert not b.isnan().any(), f"{name}: NaN (an unwritten row?)"
        over_tensor = relative_error(b, a)
        worst = sequence_head_errors(b[None], a[None], lengths).worst
        report.append(f"{name} {over_tensor:.2e} (worst slice {worst:.2e}, bitwise {torch.equal(a, b)})")
        assert over_tensor <= CANDIDATE_BOUNDS[name] and worst <= 10 * CANDIDATE_BOUNDS[name], "; ".join(report)
    print("; ".join(report))


@pytest.mark.gpu
@requires_hopper
def test_overlap_candidate_is_deterministic():
    from flashqla.hopper.backward_chunk_grads import chunk_gradients
    from flashqla.hopper.backward_chunk_grads_overlap import compile_chunk_grads_overlap

    args = kernel_inputs(RAGGED, 16, 64)
    first = run_kernel(chunk_gradients, args, compiled=compile_chunk_grads_overlap())
    second = run_kernel(chunk_gradients, args, compiled=compile_chunk_grads_overlap())
    for name, a, b in zip(OUTPUT_NAMES, first, second):
        assert torch.equal(a, b), name
