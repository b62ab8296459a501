"""The chunked torch path against the token recurrence, in float64, outputs and every gradient."""
import pytest
import torch

from flashqla import chunk_gated_delta_rule
from flashqla.reference import recurrent_gated_delta_rule
from flashqla.testing import random_inputs, relative_error

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def run_with_grads(fn, inputs, seed=1, **kwargs):
    """Run fn, backprop random cotangents of o and the final state, return outputs and grads."""
    leaves = {n: x.detach().clone().requires_grad_(True) if n in GRAD_NAMES and x is not None else x
              for n, x in inputs.items()}
    o, final = fn(**leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    loss.backward()
    grads = {n: leaves[n].grad for n in GRAD_NAMES if leaves.get(n) is not None}
    return o.detach(), final.detach(), grads


def chunked(**kwargs):
    return chunk_gated_delta_rule(**kwargs, backend="torch")


CASES = {
    "batch2-partial-chunk": dict(batch=2, seq_len=150, num_qk_heads=2, num_v_heads=4),
    "varlen-empty-and-partial": dict(seq_lens=[70, 0, 128, 1, 65], num_qk_heads=1, num_v_heads=3),
    "no-initial-state": dict(batch=1, seq_len=130, num_qk_heads=2, num_v_heads=2, with_initial_state=False),
    "strong-decay": dict(batch=1, seq_len=100, num_qk_heads=1, num_v_heads=2, decay_scale=20.0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_matches_recurrence_float64(case, l2norm):
    inputs = random_inputs(**CASES[case], head_k=16, head_v=8, dtype=torch.float64)
    o_ref, s_ref, g_ref = run_with_grads(recurrent_gated_delta_rule, inputs, use_qk_l2norm_in_kernel=l2norm)
    o, s, grads = run_with_grads(chunked, inputs, use_qk_l2norm_in_kernel=l2norm)
    assert relative_error(o, o_ref) < 1e-10
    assert relative_error(s, s_ref) < 1e-10
    assert set(grads) == set(g_ref)
    for name in grads:
        assert relative_error(grads[name], g_ref[name]) < 1e-10, name


def test_recurrence_matches_a_hand_computed_step():
    # One token with S0 = 0: S1 = beta k v^T, so o = scale * beta (q.k) v.
    q = torch.tensor([[[[1.0, 2.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.5, -1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0]]]], dtype=torch.float64)
    g = torch.tensor([[[-0.7]]], dtype=torch.float64)
    beta = torch.tensor([[[0.25]]], dtype=torch.float64)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.5, output_final_state=True)
    assert o.item() == pytest.approx(0.5 * 0.25 * (0.5 - 2.0) * 3.0)
    assert s[0, 0, :, 0].tolist() == pytest.approx([0.25 * 0.5 * 3.0, 0.25 * -1.0 * 3.0])


def test_gradcheck_tiny():
    inputs = random_inputs(seq_lens=[5, 0, 3], num_qk_heads=1, num_v_heads=2, head_k=4, head_v=3,
                           dtype=torch.float64)
    names = ["q", "k", "v", "g", "beta", "initial_state"]

    def fn(*tensors):
        kwargs = dict(zip(names, tensors))
        o, s = chunked(**kwargs, output_final_state=True, cu_seqlens=inputs["cu_seqlens"])
        return o, s

    tensors = tuple(inputs[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-7)


def test_varlen_equals_each_sequence_alone():
    lens = [64, 0, 97, 31]
    inputs = random_inputs(seq_lens=lens, num_qk_heads=2, num_v_heads=4, head_k=16, head_v=16, dtype=torch.float64)
    o, s = chunked(**inputs, output_final_state=True)
    bounds = inputs["cu_seqlens"].tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        alone = {n: inputs[n][:, start:end] for n in ("q", "k", "v", "g", "beta")}
        o_i, s_i = chunked(**alone, initial_state=inputs["initial_state"][i : i + 1], output_final_state=True)
        assert torch.allclose(o[:, start:end], o_i, rtol=1e-12, atol=1e-12)
        assert torch.allclose(s[i : i + 1], s_i, rtol=1e-12, atol=1e-12)


def test_grouped_heads_equal_repeated_qk():
    inputs = random_inputs(batch=1, seq_len=90, num_qk_heads=2, num_v_heads=6, head_k=16, head_v=8,
                           dtype=torch.float64)
    o, s = chunked(**inputs, output_final_state=True)
    repeated = dict(inputs, q=inputs["q"].repeat_interleave(3, dim=2), k=inputs["k"].repeat_interleave(3, dim=2))
    o_rep, s_rep = chunked(**repeated, output_final_state=True)
    assert relative_error(o, o_rep) < 1e-12 and relative_error(s, s_rep) < 1e-12
    # Pairing heads the other way round (h % Hqk) must differ: the grouping is not symmetric.
    tiled = dict(inputs, q=inputs["q"].repeat(1, 1, 3, 1), k=inputs["k"].repeat(1, 1, 3, 1))
    o_tiled, _ = chunked(**tiled)
    assert relative_error(o_tiled, o) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_stay_close_to_float64(dtype):
    inputs = random_inputs(seq_lens=[100, 60], num_qk_heads=2, num_v_heads=4, head_k=32, head_v=32, dtype=dtype)
    o, s = chunked(**inputs, output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    ref = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in inputs.items()}
    o_ref, s_ref = recurrent_gated_delta_rule(**ref, output_final_state=True)
    budget = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative_error(o, o_ref) < budget and relative_error(s, s_ref) < budget
