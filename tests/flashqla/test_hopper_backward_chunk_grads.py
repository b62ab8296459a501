"""Kernel-level tests of the chunk-gradient kernel (flashqla/hopper/backward_chunk_grads.py).

Its gradients against the float64 reference (the whole grid, strong decay, bitwise determinism)
are checked through `backward` in tests/flashqla/test_hopper_backward.py; here, what only the kernel shows.

CPU checks (need nvcc only): its generated CUDA waits for every TMA load group before the first
read and refills it only after the last one, and no TMA-filled buffer shares shared memory with
another buffer (the two races seen on the device while it was written were of these kinds).
GPU: the number of persistent CTAs does not change the result; the kernel that takes q, k before the
L2 norm with its r (`chunk_grads_program(normalize_qk=True)`, what the op runs with
use_qk_l2norm_in_kernel) gives the plain kernel's gradients on the l2norm kernel's q^, k^ up to bf16
rounding (it folds r into float32 factors where the plain path rounds q^, k^ to bf16), and with the norm's
backward in its epilogues (`l2norm_backward=True`) the norm's backward of its own dq^, dk^ (float64 math)
and its own dv, dg, dbeta bitwise.
"""
import re
import shutil

import pytest
import torch

from hopper_grid import RAGGED, make_backward_inputs, on_hopper, poison_allocator, sequence_head_errors

TMA_GROUPS = {"loads_b": ("w_s", "s0_s", "ds_s", "do_s"), "loads_q": ("q_s",), "loads_inv": ("inv_s",),
              "loads_k": ("k_s",)}
# Largest dynamic shared memory one H100/H200 CTA may use (227 KB), less 1 KB of static barriers.
SHARED_LIMIT_BYTES = 227 * 1024 - 1024
OUTPUT_NAMES = ("dq_head", "dk_head", "dv", "dg", "dbeta")

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the sm_90a kernels")
requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")


def test_chunk_bounds_of_ragged_batch():
    from flashqla.hopper.chunk_plan import build_forward_plan, chunk_bounds, chunk_indices

    cu_seqlens = torch.tensor([0, 100, 100, 164, 165], dtype=torch.int32)  # 100, 0, 64, 1 tokens
    bounds = chunk_bounds(cu_seqlens, chunk_indices(cu_seqlens))
    assert bounds.dtype == torch.int32 and torch.equal(chunk_bounds(cu_seqlens), bounds)
    assert bounds.tolist() == [[0, 64], [64, 36], [100, 64], [164, 1]]
    plan = build_forward_plan(cu_seqlens.tolist(), torch.device("cpu"), num_heads=4)
    assert plan.chunk_bounds.dtype == torch.int32 and torch.equal(plan.chunk_bounds, bounds)
    assert plan.chunk_index.tolist() == chunk_indices(cu_seqlens).tolist()


# chunk_grads_program's (normalize_qk, l2norm_backward)
@pytest.fixture(scope="module", params=[(False, False), (True, False), (True, True)],
                ids=["kernel", "normalizing_qk", "l2norm_backward"])
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def kernel_source(variant):
    from flashqla.hopper.backward_chunk_grads import compile_chunk_grads

    return compile_chunk_grads(*variant).get_kernel_source()


@needs_nvcc
def test_load_groups_are_waited_before_reads_and_refilled_after_last_read(kernel_source):
    """Inside the task loop, for each mbarrier group: no read of its buffers before the wait; before
    the refill, a wgmma wait after the last product reading them and a block barrier after their last
    read; no read after it."""
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
        # every product reading the buffers has been waited for (T.wait_wgmma(0), or T.gemm's own wait)
        # after it was issued (its descriptor made), and every thread is past its last read
        last_product = max(i for i in uses if "wgmma_descriptor" in lines[i])
        assert any("wait_wgmma<0>" in line or "warpgroup_wait<0>" in line
                   for line in lines[last_product:refill_at]), group
        assert any("__syncthreads()" in line for line in lines[max(uses):refill_at]), group


@needs_nvcc
def test_tma_buffers_share_no_shared_memory(variant, kernel_source):
    from flashqla.hopper.backward_chunk_grads import TMA_BUFFERS, chunk_grads_program

    assert_tma_buffers_alone(chunk_grads_program(*variant), kernel_source, TMA_BUFFERS)


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


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("lengths", [RAGGED, [8192]], ids=["ragged", "1x8192"])
@pytest.mark.parametrize("heads", [(16, 16), (8, 8), (4, 16)], ids=["16_16", "8_8", "4_16"])
def test_l2norm_in_the_kernel(heads, lengths):
    """q, k enter unnormalised (row norms 0.1-8). The kernel normalising them on chip gives the plain
    kernel's gradients on the l2norm kernel's q^, k^ within bf16 rounding (every output, over the tensor and
    per (sequence, head): a factor of r missing or misplaced anywhere would be off by up to 80x); with the
    norm's backward in its epilogues, dq, dk are its own dq^, dk^ (bf16) put through r (dy - y (y . dy)) in
    float64 per value head (the norm's backward is linear, so per head and after the group sum agree)."""
    from flashqla.hopper.backward_chunk_grads import chunk_gradients
    from flashqla.hopper.l2norm import l2_normalized
    from flashqla.testing import relative_error

    num_qk_heads, num_v_heads = heads
    group = num_v_heads // num_qk_heads
    args = kernel_inputs(lengths, *heads)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rstd, unnormalised = {}, {}
    for name in ("q", "k"):
        # the grid's q, k are unit rows: rescaled, they normalise back to themselves (up to rounding),
        # so the inverse in args still belongs to the keys
        norms = torch.empty(args[name].shape[:2] + (1,), device="cuda").uniform_(0.1, 8, generator=gen)
        unnormalised[name] = (args[name] * norms).to(torch.bfloat16)
        y, r = l2_normalized(unnormalised[name])
        args[name], rstd[name] = y, r.view(args[name].shape[:2])
    separate = run_kernel(chunk_gradients, args)
    raw = dict(args, **unnormalised, q_rstd=rstd["q"], k_rstd=rstd["k"])
    on_chip = run_kernel(chunk_gradients, raw, l2norm_backward=False)
    report = []
    for name, a, b in zip(OUTPUT_NAMES, on_chip, separate):
        assert not a.isnan().any(), f"{name}: NaN (an unwritten row?)"
        over_tensor = relative_error(a, b)
        worst = sequence_head_errors(a[None], b[None], lengths).worst
        report.append(f"{name} {over_tensor:.2e} (worst slice {worst:.2e})")
        assert over_tensor <= 1e-2 and worst <= 2e-2, "on chip against the l2norm kernel's q^, k^: " + "; ".join(report)
    fused = run_kernel(chunk_gradients, raw)
    again = run_kernel(chunk_gradients, raw)
    for index, name in ((0, "q"), (1, "k")):
        r = rstd[name].double().repeat_interleave(group, dim=1)[..., None]
        y = unnormalised[name].double().repeat_interleave(group, dim=1) * r  # [T, Hv, 128], as the kernel folds it
        dy = on_chip[index].double()
        expected = r * (dy - y * (y * dy).sum(-1, keepdim=True))
        got = fused[index]
        assert not got.isnan().any(), f"d{name}: NaN (an unwritten row?)"
        over_tensor = relative_error(got, expected)
        worst = sequence_head_errors(got[None], expected[None], lengths).worst
        report.append(f"d{name} {over_tensor:.2e} (worst slice {worst:.2e})")
        # the separate path rounds dq^ to bf16 before the norm's backward; the fused one does not
        assert over_tensor <= 4e-3 and worst <= 2e-2, "; ".join(report)
    print("; ".join(report))
    # dv, dg and dbeta are the same instructions on the same tiles
    for name, a, b in list(zip(OUTPUT_NAMES, on_chip, fused))[2:]:
        assert torch.equal(a, b), name
    for name, a, b in zip(OUTPUT_NAMES, fused, again):
        assert torch.equal(a, b), f"{name}: not deterministic"
