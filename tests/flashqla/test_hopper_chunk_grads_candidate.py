"""The chunk-gradient kernel's candidate thread count (backward_chunk_grads.CANDIDATE_THREADS) against
the verified one (THREADS), on the kernel's own inputs.

The candidate runs the same products with each split four ways along N instead of two, so dq, dk
and dv must come out bitwise; dg and dbeta are block reductions whose order follows the thread
layout, so they must agree within 1e-5 of their largest value. GPU (marked gpu, SM90): ragged
lengths (partial chunks, an empty and a one-token sequence) and one 8192-token sequence, group
sizes 4 and 1, a quarter of the heads at g = 0, one CTA walking every task, and NaN-poisoned memory
so that an unwritten output shows.
"""
import pytest
import torch

from hopper_grid import RAGGED, on_hopper
from test_hopper_backward_chunk_grads import OUTPUT_NAMES, kernel_inputs, run_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]


@pytest.mark.parametrize("num_workers", [None, 1], ids=["per_sm", "1_cta"])
@pytest.mark.parametrize("lengths", [RAGGED, [8192]], ids=["ragged", "1x8192"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8), (16, 16)], ids=["16_64", "2_8", "16_16"])
def test_candidate_threads_give_the_verified_gradients(heads, lengths, num_workers):
    from flashqla.hopper.backward_chunk_grads import CANDIDATE_THREADS, chunk_gradients

    if num_workers == 1 and lengths != RAGGED:
        pytest.skip("one CTA over 8192 tokens takes long; the ragged batch walks every refill already")
    args = kernel_inputs(lengths, *heads)
    verified = run_kernel(chunk_gradients, args)
    candidate = run_kernel(chunk_gradients, args, threads=CANDIDATE_THREADS, num_workers=num_workers)
    for name, a, b in zip(OUTPUT_NAMES, verified, candidate):
        assert not b.isnan().any(), f"{name}: NaN (an unwritten row?)"
        if name in ("dg", "dbeta"):
            worst = (a - b).abs().max().item()
            assert worst <= 1e-5 * a.abs().max().item(), f"{name}: {worst:.3e}"
        else:
            assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item():.3e}"
