"""The two-chain candidate of the chunk-gradient kernel (flashqla/hopper/backward_chunk_grads_two_chains.py).

CPU (needs nvcc only), on its generated CUDA: no TMA-filled buffer shares shared memory with another;
each chain reads v/W, S0 and dS1 only before it arrives on b_free, and group B is refilled only after
chain A has waited on it; group A is refilled after the task's block barrier and read only after
the next task's wait; every hand-off barrier is arrived on by chain A and waited on by chain B.

GPU (marked gpu, SM90): against the verified kernel (backward_chunk_grads.py, itself checked against
float64 through `backward`) on the same inputs: ragged lengths (partial chunks, an empty and a
one-token sequence) and one 8192-token sequence, group sizes 4 and 1, a quarter of the heads at
g = 0; dq, dk, dv within 1e-3 and dg, dbeta within 1e-4 (relative L2, over the tensor and worst
(sequence, head)), one CTA walking every task, bitwise determinism, NaN-poisoned memory.
"""
import re
import shutil

import pytest
import torch

from hopper_grid import RAGGED, on_hopper, sequence_head_errors
from test_hopper_backward_chunk_grads import OUTPUT_NAMES, assert_tma_buffers_alone, kernel_inputs, run_kernel

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the sm_90a kernels")
requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
BOUNDS = {"dq_head": 1e-3, "dk_head": 1e-3, "dv": 1e-3, "dg": 1e-4, "dbeta": 1e-4}


@pytest.fixture(scope="module")
def source_lines():
    from flashqla.hopper.backward_chunk_grads_two_chains import compile_chunk_grads_two_chains

    return compile_chunk_grads_two_chains().get_kernel_source().splitlines()


def _chains(lines):
    """(task loop start, chain A's lines, chain B's lines, the task's tail) as index ranges of the source."""
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for (") and "num_workers" in line)
    split = next(i for i, line in enumerate(lines) if i > loop and "if (((int)threadIdx.x) < 128)" in line)
    indent = lines[split][:len(lines[split]) - len(lines[split].lstrip())]
    b_start = next(i for i, line in enumerate(lines) if i > split and line == indent + "} else {")
    tail = next(i for i, line in enumerate(lines) if i > b_start and "loads_a[0]" in line and "tma_load" in line)
    return loop, range(split, b_start), range(b_start, tail), tail


def _reads(lines, span, names):
    return [i for i in span if "tma_load(" not in lines[i] and any(re.search(rf"\b{n}\b", lines[i]) for n in names)]


@needs_nvcc
def test_tma_buffers_share_no_shared_memory(source_lines):
    from flashqla.hopper.backward_chunk_grads_two_chains import TMA_BUFFERS, two_chain_program

    assert_tma_buffers_alone(two_chain_program(), "\n".join(source_lines), TMA_BUFFERS)


@needs_nvcc
def test_group_b_is_read_before_b_free_and_refilled_after_it(source_lines):
    lines = source_lines
    _, chain_a, chain_b, _ = _chains(lines)
    a_wait = next(i for i in chain_a if "b_free[0].wait(" in lines[i])
    a_arrive = next(i for i in chain_a if "b_free[0].arrive()" in lines[i])
    b_arrive = next(i for i in chain_b if "b_free[0].arrive()" in lines[i])
    refill = [i for i in chain_a if "tma_load(" in lines[i] and "loads_b[0]" in lines[i]]
    assert refill and min(refill) > a_wait > a_arrive
    reads_a = _reads(lines, chain_a, ("w_s", "s0_s", "ds_s"))
    assert reads_a and max(reads_a) < a_arrive, f"chain A reads group B at line {max(reads_a)}"
    reads_b = _reads(lines, chain_b, ("w_s", "s0_s", "ds_s"))
    assert reads_b and max(reads_b) < b_arrive, f"chain B reads group B at line {max(reads_b)}"
    between = lines[max(reads_a):a_arrive]
    assert any("warpgroup_wait<0>" in line for line in between)


@needs_nvcc
def test_group_a_is_refilled_after_the_task_barrier(source_lines):
    lines = source_lines
    loop, chain_a, chain_b, tail = _chains(lines)
    wait = next(i for i in range(loop, chain_a.start) if "loads_a[0].wait(" in lines[i])
    reads = _reads(lines, range(loop, tail), ("q_s", "k_s", "inv_s", "do_s"))
    assert reads and min(reads) > wait
    assert any("__syncthreads()" in line for line in lines[max(reads):tail]), "no block barrier before the refill"
    after = _reads(lines, range(tail, len(lines)), ("q_s", "k_s", "inv_s", "do_s"))
    assert not after, f"group A read at line {after[0]} after its refill"


@needs_nvcc
def test_hand_offs_go_from_chain_a_to_chain_b(source_lines):
    lines = source_lines
    _, chain_a, chain_b, _ = _chains(lines)
    for barrier in ("delta_ready", "du_ready", "x_ready"):
        assert [i for i in chain_a if f"{barrier}[0].arrive()" in lines[i]], barrier
        assert [i for i in chain_b if f"{barrier}[0].wait(" in lines[i]], barrier
        assert not [i for i in chain_a if f"{barrier}[0].wait(" in lines[i]], barrier


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("num_workers", [None, 1], ids=["per_sm", "1_cta"])
@pytest.mark.parametrize("lengths", [RAGGED, [8192]], ids=["ragged", "1x8192"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8), (16, 16)], ids=["16_64", "2_8", "16_16"])
def test_two_chains_give_the_kernels_gradients(heads, lengths, num_workers):
    from flashqla.hopper.backward_chunk_grads import chunk_gradients
    from flashqla.hopper.backward_chunk_grads_two_chains import compile_chunk_grads_two_chains
    from flashqla.testing import relative_error

    if num_workers == 1 and lengths != RAGGED:
        pytest.skip("one CTA over 8192 tokens takes long; the ragged batch walks every refill already")
    args = kernel_inputs(lengths, *heads)
    verified = run_kernel(chunk_gradients, args)
    candidate = run_kernel(chunk_gradients, args, kernel=compile_chunk_grads_two_chains(), num_workers=num_workers)
    report = []
    for name, a, b in zip(OUTPUT_NAMES, verified, candidate):
        assert not b.isnan().any(), f"{name}: NaN (an unwritten row?)"
        over_tensor = relative_error(b, a)
        worst = sequence_head_errors(b[None], a[None], lengths).worst
        report.append(f"{name} {over_tensor:.2e} (worst slice {worst:.2e}, bitwise {torch.equal(a, b)})")
        assert over_tensor <= BOUNDS[name] and worst <= 10 * BOUNDS[name], "; ".join(report)
    print("; ".join(report))


@pytest.mark.gpu
@requires_hopper
def test_two_chains_are_deterministic():
    from flashqla.hopper.backward_chunk_grads import chunk_gradients
    from flashqla.hopper.backward_chunk_grads_two_chains import compile_chunk_grads_two_chains

    args = kernel_inputs(RAGGED, 16, 64)
    first = run_kernel(chunk_gradients, args, kernel=compile_chunk_grads_two_chains())
    second = run_kernel(chunk_gradients, args, kernel=compile_chunk_grads_two_chains())
    for name, a, b in zip(OUTPUT_NAMES, first, second):
        assert torch.equal(a, b), name
