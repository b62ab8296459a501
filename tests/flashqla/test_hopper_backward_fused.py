"""GPU tests of the backward in one reverse walk (flashqla/hopper/backward_fused.py, the op's backward): every
gradient against autograd through the float64 chunked reference on the backward's grid; with q, k through the
in-kernel L2 norm (its backward in its own kernel, and the candidate with it inside the walk where Hv = Hqk),
against the walk on q^, k^ carried through the norm's backward in float64; the candidate register budget bitwise
against the walk; bitwise determinism. Pieces: test_hopper_backward_pieces.py."""
import re

import pytest
import torch

from flashqla.testing import relative_error
from hopper_grid import (GRAD_NAMES, HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, assert_close_to_reference,
                         float64_gradients, make_backward_inputs, on_hopper, poison_allocator, sequence_head_errors)


def run_backward(inputs, do, dht, **keywords):
    from flashqla.hopper.backward import backward

    poison_allocator()
    return backward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], 128 ** -0.5,
                    inputs["initial_state"], inputs["cu_seqlens"], do, dht, **keywords)


def assert_close(ours, other, seq_lens, bound=1e-2, slice_bound=2e-2):
    """Every gradient of ours within `bound` (relative L2) of other's, whole, and per (sequence, head) within
    slice_bound; the worst of each in the message."""
    failures = []
    for name, a, b in zip(GRAD_NAMES, ours, other):
        whole = float(relative_error(a, b))
        slices = sequence_head_errors(a, b, None if name == "dh0" else seq_lens)
        if not (whole <= bound and slices.worst <= slice_bound):  # also catches NaN
            failures.append(f"{name}: {whole:.2e} whole, {slices.worst:.2e} at (sequence, head) {slices.worst_index}")
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_fused_backward_matches_float64_reference(heads, lengths, with_initial_state):
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, with_initial_state)
    ours = run_backward(inputs, do, dht)
    assert ours[0].dtype == torch.bfloat16 and ours[3].dtype == torch.float32 and ours[5].dtype == torch.float32
    assert_close_to_reference(ours, float64_gradients(inputs, do, dht), LENGTHS[lengths])


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("lengths", ["1x4096", "ragged"])
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_fused_backward_strong_decay(heads, lengths):
    """A quarter of the heads with g = 0, a quarter with g down to -20 per token."""
    inputs, do, dht = make_backward_inputs(LENGTHS[lengths], *heads, True, strong_decay=True)
    assert_close_to_reference(run_backward(inputs, do, dht), float64_gradients(inputs, do, dht), LENGTHS[lengths])


def unnormalised_inputs_and_rstds(lengths, heads):
    """The backward's inputs with q, k of norms from 0.1 to 10, and their L2 norm's r as backward takes them."""
    from flashqla.hopper.l2norm import l2_normalized

    inputs, do, dht = make_backward_inputs(lengths, *heads, True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for name in ("q", "k"):
        norms = torch.exp(torch.empty(inputs[name].shape[:3], device="cuda").uniform_(-2.3, 2.3, generator=gen))
        inputs[name] = (inputs[name].float() * norms[..., None]).to(torch.bfloat16).contiguous()
    return inputs, do, dht, {f"{name}_rstd": l2_normalized(inputs[name])[1] for name in ("q", "k")}


def through_the_norm(grads, inputs, rstds):
    """The gradients of q^, k^ (grads' first two) carried to q, k through the L2 norm in float64:
    dx = r (dy - y <y, dy>) with y = r x, per row; the others as they are."""
    carried = []
    for dy, x, r in zip(grads[:2], (inputs["q"], inputs["k"]), (rstds["q_rstd"], rstds["k_rstd"])):
        r = r.double().view(x.shape[:3])[..., None]
        y, dy = x.double() * r, dy.double()
        carried.append(r * (dy - y * (y * dy).sum(-1, keepdim=True)))
    return (*carried, *grads[2:])


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("heads,lengths,norm_in_walk", [
    ((16, 16), RAGGED, False), ((2, 8), RAGGED, False), ((16, 16), RAGGED, True), ((4, 4), [8192], True)],
    ids=["16_16_ragged", "2_8_ragged", "16_16_ragged_norm_in_walk", "4_4_1x8192_norm_in_walk"])
def test_fused_backward_with_the_l2_norm_matches_the_walk_on_normalised_inputs(heads, lengths, norm_in_walk):
    """q, k unnormalised (norms from 0.1 to 10) with the norm's r: the walk folds r into its factors, and the
    norm's kernel carries dq, dk back (summing each head group at 2/8), or with norm_in_fused_walk the walk does on
    chip (the first half of dq waits in shared memory for the row dot of both; full chunks stored by TMA, partial
    ones by the threads); against the walk on q^, k^ made in float32 and rounded to bf16, its dq^, dk^ carried
    through the norm in float64. Both sides round to bf16 in their own places, so a (sequence, head) may differ by
    the sum of what each may be from float64 (2 x 2e-2): dg on a 129-token sequence at 2/8 differed by 2.67e-2
    (4.4e-3 over the tensor; H100, forty-first session)."""
    inputs, do, dht, rstds = unnormalised_inputs_and_rstds(lengths, heads)
    ours = run_backward(inputs, do, dht, norm_in_fused_walk=norm_in_walk, **rstds)
    normalised = dict(inputs)
    for name in ("q", "k"):
        r = rstds[f"{name}_rstd"].view(inputs[name].shape[:3])[..., None]
        normalised[name] = (inputs[name].float() * r).to(torch.bfloat16)
    assert_close(ours, through_the_norm(run_backward(normalised, do, dht), inputs, rstds), lengths, slice_bound=4e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("lengths", [RAGGED, [8192]], ids=["ragged", "1x8192"])
@pytest.mark.parametrize("heads", [(16, 16), (4, 4)], ids=["16_16", "4_4"])
def test_the_norms_backward_in_the_walk_matches_its_own_kernel(heads, lengths):
    """norm_in_fused_walk: dq, dk through the norm on chip (the first half of dq waits in shared memory for the
    row dot of both), on full chunks (stored by TMA) and partial ones (by the threads), against the walk followed
    by the norm's own kernel (the op's path today); both named, so either may be backward's default."""
    inputs, do, dht, rstds = unnormalised_inputs_and_rstds(lengths, heads)
    in_walk = run_backward(inputs, do, dht, norm_in_fused_walk=True, **rstds)
    assert_close(in_walk, run_backward(inputs, do, dht, norm_in_fused_walk=False, **rstds), lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("heads,lengths,norm", [
    ((16, 64), [4096], None), ((2, 8), RAGGED, None), ((2, 8), RAGGED, "kernel"), ((16, 16), [8192], "kernel"),
    ((16, 16), RAGGED, "in_walk"), ((4, 4), [8192], "in_walk")],
    ids=["16_64_1x4096", "2_8_ragged", "2_8_ragged_norm", "16_16_1x8192_norm", "16_16_ragged_norm_in_walk",
         "4_4_1x8192_norm_in_walk"])
def test_candidates_are_bitwise_the_walk(heads, lengths, norm):
    """The register budget with the loads role at 24 (DELTA_HEAVY_REGISTERS) changes no arithmetic, so every
    gradient is bitwise the walk's: on full and partial chunks, pieces with warm-up chunks (one long sequence),
    without the norm, with it, and with its backward in the walk. A role whose budget ptxas cannot meet, or a
    setmaxnreg that leaves a role short, shows as changed bits or a failed launch."""
    from flashqla.hopper.backward_fused import DELTA_HEAVY_REGISTERS

    if norm is None:
        inputs, do, dht = make_backward_inputs(lengths, *heads, True)
        keywords = {}
    else:
        inputs, do, dht, keywords = unnormalised_inputs_and_rstds(lengths, heads)
        keywords["norm_in_fused_walk"] = norm == "in_walk"
    walk = run_backward(inputs, do, dht, **keywords)
    candidate = run_backward(inputs, do, dht, walk_registers=DELTA_HEAVY_REGISTERS, **keywords)
    failures = [(name, float(relative_error(a, b))) for name, a, b in zip(GRAD_NAMES, walk, candidate)
                if not torch.equal(a, b)]
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_fused_backward_is_bitwise_deterministic(heads):
    inputs, do, dht = make_backward_inputs(RAGGED, *heads, True)
    first = run_backward(inputs, do, dht)
    second = run_backward(inputs, do, dht)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("num_qk_heads,with_rstds", [(2, True), (4, False)], ids=["grouped", "no_rstds"])
def test_the_norms_backward_in_the_walk_refuses_what_it_cannot_do(num_qk_heads, with_rstds):
    """Before anything is allocated or compiled (CPU): the norm's backward in the walk needs the norm's r and a
    q, k head for every value head."""
    from flashqla.hopper.backward_fused import fused_backward_grads

    q = torch.zeros(64, num_qk_heads, 128, dtype=torch.bfloat16)
    v = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    rstds = (torch.ones(64, num_qk_heads),) * 2 if with_rstds else None
    with pytest.raises(ValueError, match=r"l2norm_backward needs rstds and as many q, k heads as value heads"):
        fused_backward_grads(q, q, v, *[None] * 11, rstds=rstds, l2norm_backward=True)


@pytest.mark.parametrize("registers", [(160, 184, 152, 24), (160, 168, 152, 20), (160, 168, 152), (120, 168, 152, 32)],
                         ids=["over_64k", "below_the_floor", "three_roles", "state_lowered"])
def test_the_walks_register_budget_refuses_what_setmaxnreg_cannot_do(registers):
    """CPU, before anything is built: four budgets, multiples of 8, the loads' lowered to no less than 24, the
    others raised, within the SM's 64K registers."""
    from flashqla.hopper.backward_fused import fused_backward_program

    with pytest.raises(ValueError, match=r"registers must be 4 multiples of 8.*got " + re.escape(str(registers))):
        fused_backward_program(registers=registers)
