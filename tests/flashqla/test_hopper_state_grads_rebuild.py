"""The candidate state-gradient walk that builds Ab and P on chip from A~, gamma, beta, q and k
(`state_gradients(..., rebuild_from=(inverse, beta))`) against the walk the backward runs on the forward's kept Ab and
P. Not reachable from the public op until these pass on a GPU (tools/device_session.sh lists this file among the
unverified)."""
import pytest
import torch

from hopper_grid import make_backward_inputs, on_hopper, poison_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")]
SCALE = 128 ** -0.5
# (heads, lengths): whole sequences (ragged: empty, 1-token, partial chunks) and ones the planner cuts into pieces
CASES = {"4_16_ragged": ((4, 16), [1, 0, 63, 64, 65, 1000, 129]), "2_8_32768": ((2, 8), [32768]),
         "8_24_28672+4096": ((8, 24), [28672, 4096]), "16_16_65536": ((16, 16), [65536]),
         "1_16_ragged": ((1, 16), [8192, 1000, 0, 3000])}


def both_walks(heads, lengths, normalize_qk: bool):
    """(the walk's (dS, dh0) on the kept Ab and P, the candidate's on A~ and beta), on the forward's kept tensors
    and the backward's plan; with normalize_qk, q and k unnormalised (row norms 0.5-3) and the op's norm on."""
    from flashqla.hopper.backward import MAX_VALUE_BLOCK, state_gradient_walk
    from flashqla.hopper.backward_state_grads import state_gradients
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward
    from flashqla.hopper.forward import forward

    inputs, do, dht = make_backward_inputs(lengths, *heads, True, strong_decay=True)
    q, k = inputs["q"], inputs["k"]
    if normalize_qk:
        generator = torch.Generator(device=q.device).manual_seed(7)
        q, k = ((x.float() * (0.5 + 2.5 * torch.rand(*x.shape[:3], 1, generator=generator, device=x.device)))
                .to(x.dtype) for x in (q, k))
    cu = inputs["cu_seqlens"]
    sm_count = device_sm_count(cu.device)
    plan = plan_forward(cu, heads[1], 128, sm_count, MAX_VALUE_BLOCK)
    _, _, kept, *flat_rstds = forward(q, k, inputs["v"], inputs["g"], inputs["beta"], SCALE, inputs["initial_state"],
                                      False, cu, keep_for_backward=True, normalize_qk=normalize_qk)
    rstds = tuple(r.view(q.shape[1], heads[0]) for r in flat_rstds) if normalize_qk else None
    walk = state_gradient_walk(plan, kept.gamma, cu, cu.tolist(), heads[1], sm_count)
    common = dict(do=do[0], dht=dht, scale=SCALE, cu_seqlens=cu, offsets=plan.chunk_offsets,
                  num_chunks=plan.chunk_index.shape[0], rstds=rstds, **walk)
    poison_allocator()
    expected = state_gradients(q[0], k[0], kept.gamma, kept.gated_inverse, kept.scores, **common)
    poison_allocator()
    beta = inputs["beta"][0].float().contiguous()
    rebuilt = state_gradients(q[0], k[0], kept.gamma, None, None, **common,
                              rebuild_from=(kept.inverse.to(torch.bfloat16), beta))
    return expected, rebuilt


def worst_slice(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest relative L2 distance over the [K, V] slices (chunk or sequence, head) where theirs is not zero."""
    difference = (ours.double() - theirs.double()).flatten(2).norm(dim=2)
    size = theirs.double().flatten(2).norm(dim=2)
    return float((difference[size > 0] / size[size > 0]).max())


@pytest.mark.parametrize("normalize_qk", [False, True], ids=["plain", "normalize_qk"])
@pytest.mark.parametrize("case", list(CASES))
def test_rebuilt_products_give_the_walks_state_gradients(case, normalize_qk):
    """Within bf16 rounding (Ab and P are rounded from other float32 values than the forward's) over the tensor and
    in every (chunk, head) and (sequence, head); nothing unwritten under NaN-poisoned memory."""
    from flashqla.testing import relative_error

    (walk_ds, walk_dh0), (ours_ds, ours_dh0) = both_walks(*CASES[case], normalize_qk)
    assert torch.isfinite(ours_ds).all() and torch.isfinite(ours_dh0).all()
    errors = (relative_error(ours_ds, walk_ds), relative_error(ours_dh0, walk_dh0))
    assert max(errors) <= 5e-3, errors
    worst = (worst_slice(ours_ds, walk_ds), worst_slice(ours_dh0, walk_dh0))
    print(f"{case} {normalize_qk}: tensor {errors}, worst slice {worst}")
    assert max(worst) <= 2e-2, worst


def test_rebuilt_products_are_deterministic():
    first, second = (both_walks(*CASES["8_24_28672+4096"], True)[1] for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
