"""Kernel-level tests of the chunk-gradient kernel (flashqla/hopper/backward_chunk_grads.py).

Its gradients against the float64 reference (the whole grid, strong decay, bitwise determinism)
are checked through `backward` in tests/flashqla/test_hopper_backward.py; here, what only the kernel shows.

CPU checks (need nvcc only): its generated CUDA waits for every TMA load group before the first
read and refills it only after the last one, and no TMA-filled buffer shares shared memory with
another buffer (the two races seen on the device while it was written were of these kinds).
GPU: the number of persistent CTAs does not change the result.
"""
import re
import shutil

import pytest
import torch

from hopper_grid import RAGGED, make_backward_inputs, on_hopper, poison_allocator

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


@pytest.fixture(scope="module")
def kernel_source():
    from flashqla.hopper.backward_chunk_grads import compile_chunk_grads

    return compile_chunk_grads().get_kernel_source()


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
        # every product issued before the refill has been waited for (T.wait_wgmma(0), or T.gemm's own wait)
        assert any("wait_wgmma<0>" in line or "warpgroup_wait<0>" in line for line in between), group
        assert any("__syncthreads()" in line for line in between), group


@needs_nvcc
def test_tma_buffers_share_no_shared_memory(kernel_source):
    from flashqla.hopper.backward_chunk_grads import TMA_BUFFERS, chunk_grads_program

    assert_tma_buffers_alone(chunk_grads_program(), kernel_source, TMA_BUFFERS)


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
