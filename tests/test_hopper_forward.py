"""GPU tests of the TileLang forward kernels (flashqla/hopper) against the float64 references.

Needs an SM90 GPU: skipped elsewhere. Grid of the issue: head layouts x lengths x initial state.
"""
import pytest
import torch
import torch.nn.functional as F

from flashqla import reference
from flashqla.testing import relative_error

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

from flashqla import hopper  # noqa: E402  (imports tilelang; only where the kernels can run)

TOLERANCE = 2e-2
HEAD_LAYOUTS = [(16, 64), (16, 32), (16, 16), (8, 24), (2, 8)]
# Ragged: partial chunks, an empty sequence, a one-token sequence, exact multiples of 64.
RAGGED = [1000, 0, 64, 2047, 1, 129, 640]
LENGTHS = {"1x4096": [4096], "ragged": RAGGED, "1x32768": [32768]}


def make_inputs(seq_lens, num_qk_heads, num_v_heads, with_initial_state, dtype=torch.bfloat16, seed=0,
                mixed_decay=True):
    """Anchors-like inputs drawn on the GPU; with mixed_decay a quarter of the heads never decay
    and a quarter decay 16x faster than the rest."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(seq_lens)
    dev = "cuda"

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)

    q = F.normalize(randn(1, total, num_qk_heads, 128), dim=-1).to(dtype)
    k = F.normalize(randn(1, total, num_qk_heads, 128), dim=-1).to(dtype)
    v = randn(1, total, num_v_heads, 128).to(dtype)
    g = F.logsigmoid(randn(1, total, num_v_heads)) / 16
    if mixed_decay and num_v_heads >= 4:
        quarter = num_v_heads // 4
        g[..., :quarter] = 0.0
        g[..., quarter:2 * quarter] *= 16
    beta = torch.rand(1, total, num_v_heads, generator=gen, device=dev).sigmoid()
    cu_seqlens = torch.tensor([0, *seq_lens], device=dev).cumsum(0).to(torch.int32)
    h0 = randn(len(seq_lens), num_v_heads, 128, 128) if with_initial_state else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu_seqlens)


def float64_reference(inputs):
    args = {name: (x.double() if x is not None and x.is_floating_point() else x) for name, x in inputs.items()}
    total = inputs["q"].shape[1]
    # The token loop is the ground truth; for 32k tokens the chunked float64 form (checked
    # against it in tests/test_reference.py) keeps the test quick.
    fn = reference.recurrent_gated_delta_rule if total <= 8192 else reference.chunk_gated_delta_rule_torch
    return fn(args["q"], args["k"], args["v"], args["g"], args["beta"], initial_state=args["initial_state"],
              output_final_state=True, cu_seqlens=args["cu_seqlens"])


def poison_allocator():
    """Fill the caching allocator's free blocks with NaN so unwritten outputs show."""
    free = torch.cuda.mem_get_info()[0]
    junk = torch.empty(min(free // 4, 8 << 30) // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
    del junk


def run_forward(inputs):
    poison_allocator()
    return hopper.forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None,
                          inputs["initial_state"], True, inputs["cu_seqlens"])


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=[f"{a}_{b}" for a, b in HEAD_LAYOUTS])
def test_forward_matches_float64_reference(heads, lengths, with_initial_state):
    inputs = make_inputs(LENGTHS[lengths], *heads, with_initial_state, seed=heads[1] * 10 + list(LENGTHS).index(lengths))
    o, final_state = run_forward(inputs)
    torch.cuda.synchronize()
    assert o.shape == inputs["v"].shape and o.dtype == inputs["v"].dtype
    assert torch.isfinite(o).all(), "NaN/Inf in o (unwritten rows?)"
    assert torch.isfinite(final_state).all()
    ref_o, ref_state = float64_reference(inputs)
    err_o = relative_error(o, ref_o)
    err_state = relative_error(final_state, ref_state)
    assert err_o <= TOLERANCE, f"o relative L2 error {err_o:.3e}"
    assert err_state <= TOLERANCE, f"final state relative L2 error {err_state:.3e}"


@pytest.mark.parametrize("heads", [(16, 64), (2, 8)], ids=["16_64", "2_8"])
def test_forward_is_bitwise_deterministic(heads):
    inputs = make_inputs(RAGGED + [4096], *heads, with_initial_state=True, seed=7)
    o1, s1 = run_forward(inputs)
    o2, s2 = run_forward(inputs)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_forward_float16_inputs():
    inputs = make_inputs([777, 1536], 4, 16, with_initial_state=True, dtype=torch.float16, seed=3)
    o, final_state = run_forward(inputs)
    ref_o, ref_state = float64_reference(inputs)
    assert o.dtype == torch.float16
    assert relative_error(o, ref_o) <= TOLERANCE
    assert relative_error(final_state, ref_state) <= TOLERANCE


def test_chunk_states_match_fused_forward_final_state():
    """The state-only kernel's final state equals the fused kernel's, and its first chunk state is h0."""
    from flashqla.hopper.chunk_plan import chunk_offsets
    from flashqla.hopper.chunk_states import chunk_states
    from flashqla.hopper.cumsum import chunk_local_cumsum
    from flashqla.hopper.inverse import gate_free_inverse

    inputs = make_inputs(RAGGED, 2, 8, with_initial_state=True, seed=11)
    cu = inputs["cu_seqlens"]
    T = inputs["q"].shape[1]
    gamma = chunk_local_cumsum(inputs["g"], cu).view(T, 8)
    inverse = gate_free_inverse(inputs["k"], inputs["beta"], cu).view(T, 8, 64)
    states, final_state, _ = chunk_states(inputs["k"][0], inputs["v"][0], gamma, inputs["beta"][0], inverse,
                                          inputs["initial_state"], cu, value_block=64)
    _, ref_state = float64_reference(inputs)
    assert relative_error(final_state, ref_state) <= TOLERANCE
    offsets = chunk_offsets(cu).tolist()
    for n, length in enumerate(RAGGED):
        if length:
            first = states[offsets[n]].float()
            assert relative_error(first, inputs["initial_state"][n]) <= 1e-2


def test_chunk_states_transition_composes():
    """S_end = M S_start + S_end|0 for the transition M of a sequence."""
    from flashqla.hopper.chunk_states import chunk_states
    from flashqla.hopper.cumsum import chunk_local_cumsum
    from flashqla.hopper.inverse import gate_free_inverse

    inputs = make_inputs([1000, 2048], 2, 8, with_initial_state=True, seed=5)
    cu = inputs["cu_seqlens"]
    T = inputs["q"].shape[1]
    gamma = chunk_local_cumsum(inputs["g"], cu).view(T, 8)
    inverse = gate_free_inverse(inputs["k"], inputs["beta"], cu).view(T, 8, 64)
    args = (inputs["k"][0], inputs["v"][0], gamma, inputs["beta"][0], inverse)
    _, zero_start, transition = chunk_states(*args, None, cu, value_block=64, store_chunk_states=False,
                                             with_transition=True)
    _, with_h0, _ = chunk_states(*args, inputs["initial_state"], cu, value_block=64, store_chunk_states=False)
    composed = transition @ inputs["initial_state"] + zero_start
    assert relative_error(composed, with_h0) <= TOLERANCE


def test_rejects_other_head_dims():
    inputs = make_inputs([128], 2, 8, with_initial_state=False)
    with pytest.raises(ValueError, match="K = V = 128"):
        hopper.forward(inputs["q"][..., :64], inputs["k"][..., :64], inputs["v"], inputs["g"], inputs["beta"],
                       None, None, False, inputs["cu_seqlens"])


@pytest.mark.parametrize("lengths", [[32768], [28672, 4096], [8192] * 4], ids=["1x32768", "28672+4096", "8192x4"])
def test_split_sequences_exact_and_truncated(lengths):
    """Pieces of split sequences (2/8 heads: few CTAs) rebuild their entering state by a warm-up walk;
    exact (-inf) and truncated (-10) histories both match the reference, including a head with no decay."""
    inputs = make_inputs(lengths, 2, 8, with_initial_state=True, seed=21)
    ref_o, ref_state = float64_reference(inputs)
    for threshold in (float("-inf"), -10.0):
        poison_allocator()
        o, final_state = hopper.forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None,
                                        inputs["initial_state"], True, inputs["cu_seqlens"],
                                        log_decay_threshold=threshold)
        assert relative_error(o, ref_o) <= TOLERANCE, threshold
        assert relative_error(final_state, ref_state) <= TOLERANCE, threshold
