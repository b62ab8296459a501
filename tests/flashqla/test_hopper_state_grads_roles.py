"""The candidate state-gradient walk split by role (state_grads_roles.py) against the walk the backward runs
(backward_state_grads.py) and, through the whole backward, against float64 autograd. Not reachable from the
public op until these pass on a GPU (tools/device_session.sh lists this file among the unverified)."""
import pytest
import torch

from hopper_grid import (GRAD_NAMES, assert_close_to_reference, float64_gradients, make_backward_inputs, on_hopper,
                         poison_allocator)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]
SCALE = 128 ** -0.5
# (heads, lengths): whole sequences (ragged: empty, 1-token, partial chunks) and ones the planner cuts into pieces
CASES = {"4_16_ragged": ((4, 16), [1, 0, 63, 64, 65, 1000, 129]), "2_8_32768": ((2, 8), [32768]),
         "8_24_28672+4096": ((8, 24), [28672, 4096]), "16_16_65536": ((16, 16), [65536]),
         "1_16_ragged": ((1, 16), [8192, 1000, 0, 3000])}


def both_walks(heads, lengths, normalize_qk: bool):
    """(the walk's (dS, dh0), the candidate's), on the forward's kept tensors and the backward's plan."""
    from flashqla.hopper.backward import MAX_VALUE_BLOCK, state_gradient_walk
    from flashqla.hopper.backward_state_grads import state_gradients
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward
    from flashqla.hopper.forward import forward
    from flashqla.hopper.l2norm import l2_normalized
    from flashqla.hopper.state_grads_roles import state_gradients_by_roles

    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    q, k = inputs["q"][0], inputs["k"][0]
    rstds = None
    if normalize_qk:  # rows of norms 0.5 to 3, so that r matters
        generator = torch.Generator(device=q.device).manual_seed(7)
        q, k = ((x.float() * (0.5 + 2.5 * torch.rand(*x.shape[:2], 1, generator=generator, device=x.device)))
                .to(x.dtype) for x in (q, k))
        rstds = tuple(l2_normalized(x)[1].view(x.shape[:2]) for x in (q, k))
    cu = inputs["cu_seqlens"]
    sm_count = device_sm_count(cu.device)
    plan = plan_forward(cu, heads[1], 128, sm_count, MAX_VALUE_BLOCK)
    _, _, kept = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], SCALE,
                         inputs["initial_state"], False, cu, keep_for_backward=True)
    walk = state_gradient_walk(plan, kept.gamma, cu, cu.tolist(), heads[1], sm_count)
    args = (q, k, kept.gamma, kept.gated_inverse, kept.scores, do[0], dht, SCALE, cu, plan.chunk_offsets,
            plan.chunk_index.shape[0])
    poison_allocator()
    expected = state_gradients(*args, **walk, rstds=rstds)
    poison_allocator()
    return expected, state_gradients_by_roles(*args, **walk, rstds=rstds)


@pytest.mark.parametrize("normalize_qk", [False, True], ids=["plain", "normalize_qk"])
@pytest.mark.parametrize("case", list(CASES))
def test_roles_match_the_walk(case, normalize_qk):
    """Within bf16 rounding over the tensor and in every (chunk, head) and (sequence, head); nothing unwritten."""
    from flashqla.testing import relative_error

    (walk_ds, walk_dh0), (roles_ds, roles_dh0) = both_walks(*CASES[case], normalize_qk)
    assert torch.isfinite(roles_ds).all() and torch.isfinite(roles_dh0).all()
    assert relative_error(roles_ds, walk_ds) <= 5e-3 and relative_error(roles_dh0, walk_dh0) <= 5e-3
    worst_chunk, worst_sequence = (worst_slice(ours, theirs) for ours, theirs in ((roles_ds, walk_ds),
                                                                                   (roles_dh0, walk_dh0)))
    assert worst_chunk <= 2e-2 and worst_sequence <= 2e-2, (worst_chunk, worst_sequence)


def worst_slice(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest relative L2 distance over the [K, V] slices (chunk or sequence, head) where theirs is not zero."""
    difference = (ours.double() - theirs.double()).flatten(2).norm(dim=2)
    size = theirs.double().flatten(2).norm(dim=2)
    return float((difference[size > 0] / size[size > 0]).max())


def test_roles_are_deterministic():
    first, second = (both_walks(*CASES["8_24_28672+4096"], True)[1] for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("case", ["4_16_ragged", "2_8_32768"])
def test_backward_with_the_roles_walk_matches_float64(case, monkeypatch):
    """The whole backward (the public path's kernels) with the candidate in the walk's place."""
    import flashqla.hopper.backward as backward_module
    from flashqla.hopper.state_grads_roles import state_gradients_by_roles

    monkeypatch.setattr(backward_module, "state_gradients", state_gradients_by_roles)
    heads, lengths = CASES[case]
    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    poison_allocator()
    ours = backward_module.backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], SCALE,
                                    inputs["initial_state"], inputs["cu_seqlens"], do, dht)
    for name, grad in zip(GRAD_NAMES, ours):
        assert torch.isfinite(grad).all(), name
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht), lengths)
