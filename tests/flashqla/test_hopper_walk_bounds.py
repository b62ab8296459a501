"""The walk-bounds kernel (flashqla/hopper/walk_bounds.py) against its torch definition:
chunk_plan.walk_starts (the forward's warm-up starts) and walk_ends (the backward's), bitwise.

GPU (marked gpu, SM90), on the plans of single long sequences and of ragged batches, with heads that
never decay (every bound at the sequence edge), weak decay (warm-ups of ~150 chunks: several warp
steps), rare strong spikes and the anchors' decay, at thresholds -10, -3 and -inf.
"""
import pytest
import torch
import torch.nn.functional as F

from hopper_grid import float64_gamma, on_hopper

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]

# (heads, lengths): the bench's long single sequences and ragged batches the planner cuts
PLANS = {"2_8_131072": (8, [131072]), "16_16_131072": (16, [131072]), "16_64_32768": (64, [32768]),
         "8_24_28672+4096": (24, [28672, 4096]), "4_16_ragged": (16, [8192, 1000, 0, 3000, 1, 20000])}


def chunk_local_gamma(cu_seqlens: torch.Tensor, num_heads: int, seed: int) -> torch.Tensor:
    """gamma [T, H] of a g with, by head: no decay, weak decay (-1e-3), rare -12 spikes, the anchors'."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = int(cu_seqlens[-1])
    anchors = F.logsigmoid(torch.randn(total, num_heads, generator=gen, device="cuda")) / 16
    spikes = torch.where(torch.rand(total, num_heads, generator=gen, device="cuda") < 1e-3, -12.0, 0.0)
    profile = torch.arange(num_heads, device="cuda") % 4
    g = torch.where(profile == 0, 0.0, torch.where(profile == 1, -1e-3, torch.where(profile == 2, spikes, anchors)))
    return float64_gamma(g, cu_seqlens).float()


@pytest.mark.parametrize("threshold", [-10.0, -3.0, float("-inf")], ids=["minus10", "minus3", "exact"])
@pytest.mark.parametrize("name", list(PLANS))
def test_walk_bounds_equal_the_torch_ops(name, threshold):
    from flashqla.hopper.chunk_plan import plan_forward, walk_ends, walk_starts
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK
    from flashqla.hopper.walk_bounds import walk_bounds

    num_heads, lengths = PLANS[name]
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    plan = plan_forward(cu_seqlens, num_heads, 128, torch.cuda.get_device_properties().multi_processor_count,
                        MAX_VALUE_BLOCK)
    assert plan.max_walk_back > 0, f"{name}: the planner did not cut it"
    gamma = chunk_local_gamma(cu_seqlens, num_heads, seed=len(name))
    starts = walk_starts(plan.pieces, cu_seqlens, gamma, threshold)
    ends = walk_ends(plan.pieces, cu_seqlens, gamma, threshold)
    kernel_starts = walk_bounds(gamma, plan.pieces, cu_seqlens, ahead=False, log_decay_threshold=threshold)
    kernel_ends = walk_bounds(gamma, plan.pieces, cu_seqlens, ahead=True, log_decay_threshold=threshold)
    assert kernel_starts.dtype == kernel_ends.dtype == torch.int32
    assert torch.equal(kernel_starts, starts), (kernel_starts != starts).nonzero()[:8].tolist()
    assert torch.equal(kernel_ends, ends), (kernel_ends != ends).nonzero()[:8].tolist()
    if threshold == -3.0:  # the test can tell: some pieces warm up over part of their history only
        first = plan.pieces[:, 1].long()
        seq_start = cu_seqlens.long()[plan.pieces[:, 0].long()]
        partial = (kernel_starts.long() > seq_start[:, None]) & (kernel_starts.long() < first[:, None])
        assert partial.any()
