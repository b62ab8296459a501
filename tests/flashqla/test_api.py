"""The public op's contract: backend choice (flashqla/backends.py), and a clear error for every bad input."""
import pytest
import torch

from flashqla import backends, chunk_gated_delta_rule
from flashqla.testing import random_inputs


def small(**overrides):
    inputs = random_inputs(seq_lens=[10, 6], num_qk_heads=2, num_v_heads=4, head_k=8, head_v=8,
                           dtype=torch.float32)
    inputs.update(overrides)
    return inputs


def test_auto_picks_torch_on_cpu():
    inputs = small()
    assert backends.select("auto", inputs["q"], inputs["v"]).name == "torch"


def test_the_environment_does_not_choose(monkeypatch):
    """The old process-wide switches are gone: only the arguments decide."""
    q = torch.zeros(1, 1, 1, 8)
    monkeypatch.setenv("FLASHQLA_BACKEND", "fla")
    assert backends.select("auto", q, q).name == "torch"


def test_auto_takes_the_first_backend_by_priority_that_verifies(monkeypatch):
    """tilelang first where its verifier accepts; passing over a backend this machine offers warns
    once with the verifier's reason; one it does not offer (no GPU here) passes silently."""
    import warnings

    def fake_hopper(offered):
        return backends.Backend("tilelang", 0, lambda device: None if offered else "needs a CUDA GPU",
                                lambda q, v: None if q.shape[-1] == 128 else f"needs K = V = 128, got K={q.shape[-1]}",
                                backends.REGISTRY["tilelang"].run)

    order = backends._AUTO_ORDER
    monkeypatch.setattr(backends, "_AUTO_ORDER", [fake_hopper(True), order[1]])
    assert backends.select("auto", torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, 1, 128)).name == "tilelang"
    with pytest.warns(UserWarning, match="backend 'tilelang' needs K = V = 128, got K=8; backend='auto' runs 'torch'"):
        assert backends.select("auto", torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8)).name == "torch"
    monkeypatch.setattr(backends, "_AUTO_ORDER", [fake_hopper(False), order[1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.select("auto", torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16)).name == "torch"


def test_fla_is_only_run_when_named():
    assert backends.REGISTRY["fla"].priority is None
    assert all(b.name != "fla" for b in backends._AUTO_ORDER)


def test_backend_unavailable_reason_on_this_machine():
    cpu = torch.device("cpu")
    assert backends.backend_unavailable_reason("auto", cpu) is None
    assert backends.backend_unavailable_reason("torch", cpu) is None
    assert backends.backend_unavailable_reason("tilelang", cpu) == "backend 'tilelang' needs a CUDA GPU, got device cpu"
    assert backends.backend_unavailable_reason("fla", cpu).startswith("backend 'fla' needs a CUDA GPU")
    assert backends.backend_unavailable_reason("triton", cpu) == f"expected one of {backends.BACKENDS}"


def test_final_state_only_when_asked():
    o, s = chunk_gated_delta_rule(**small())
    assert s is None and o.shape == (1, 16, 4, 8)


def test_explicit_gpu_backends_refuse_cpu_tensors():
    with pytest.raises(ValueError, match="backend='tilelang' needs a CUDA GPU, got device cpu"):
        chunk_gated_delta_rule(**small(), backend="tilelang")
    with pytest.raises(ValueError, match="backend='fla' needs a CUDA GPU, got device cpu"):
        chunk_gated_delta_rule(**small(), backend="fla")
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_gated_delta_rule(**small(), backend="triton")


def _bad_cases():
    base = small()
    q, v = base["q"], base["v"]
    return {
        "q rank": (dict(q=q[0]), ValueError, r"q must have rank 4.*\(16, 2, 8\)"),
        "q not a tensor": (dict(q=q.tolist()), TypeError, "q must be a torch.Tensor, got list"),
        "integer v": (dict(v=v.long()), TypeError, "v must be a floating-point tensor, got dtype torch.int64"),
        "k shape": (dict(k=base["k"][:, :, :1]), ValueError, r"k must have q's shape \(1, 16, 2, 8\)"),
        "v length": (dict(v=v[:, :15]), ValueError, r"v must be \[B, T, Hv, V\] with q's B, T = \(1, 16\)"),
        "heads not a multiple": (dict(v=v[:, :, :3], g=base["g"][:, :, :3], beta=base["beta"][:, :, :3]),
                                 ValueError, "Hv=3 must be a positive multiple of .* Hqk=2"),
        "g shape": (dict(g=base["g"][:, :, :2]), ValueError, r"g must be \[B, T, Hv\] = \(1, 16, 4\), got shape \(1, 16, 2\)"),
        "beta rank": (dict(beta=base["beta"][..., None]), ValueError, "beta must have rank 3"),
        "mixed dtypes": (dict(v=v.double()), TypeError, "q, k and v must share one dtype.*float64"),
        "meta device": (dict(k=base["k"].to("meta")), ValueError, "k is on meta but q is on cpu"),
        "bad scale": (dict(scale=-1.0), ValueError, "scale must be a positive number or None, got -1.0"),
        "float cu_seqlens": (dict(cu_seqlens=torch.tensor([0.0, 10.0, 16.0])), TypeError,
                             "cu_seqlens must have dtype int32 or int64, got torch.float32"),
        "cu_seqlens not from 0": (dict(cu_seqlens=torch.tensor([1, 10, 16])), ValueError, "start at 0 and end at T = 16, got first 1"),
        "cu_seqlens short of T": (dict(cu_seqlens=torch.tensor([0, 10, 15])), ValueError, "end at T = 16, got first 0 and last 15"),
        "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 12, 10, 16]), initial_state=None), ValueError,
                                  r"non-decreasing, got \[0, 12, 10, 16\]"),
        "cu_seqlens rank": (dict(cu_seqlens=torch.tensor([[0, 16]])), ValueError, "cu_seqlens must be 1-D"),
        "cu_seqlens with B > 1": (dict(q=q.expand(2, -1, -1, -1), k=base["k"].expand(2, -1, -1, -1), v=v.expand(2, -1, -1, -1),
                                       g=base["g"].expand(2, -1, -1), beta=base["beta"].expand(2, -1, -1)),
                                  ValueError, "cu_seqlens needs packed inputs with B = 1, got B = 2"),
        "initial_state N": (dict(initial_state=base["initial_state"][:1]), ValueError,
                            r"initial_state must be \[N, Hv, K, V\] = \(2, 4, 8, 8\).*got shape \(1, 4, 8, 8\)"),
        "initial_state dtype": (dict(initial_state=base["initial_state"].long()), TypeError, "initial_state must be a floating-point"),
        "cu_seqlens_cpu alone": (dict(cu_seqlens=None, cu_seqlens_cpu=torch.tensor([0, 10, 16]), initial_state=None),
                                 ValueError, "cu_seqlens_cpu was given without cu_seqlens"),
        "cu_seqlens_cpu off the CPU": (dict(cu_seqlens_cpu=torch.tensor([0, 10, 16]).to("meta")), ValueError,
                                       "cu_seqlens_cpu must be an integer tensor on the CPU, got one on meta"),
        "cu_seqlens_cpu a list": (dict(cu_seqlens_cpu=[0, 10, 16]), TypeError,
                                  "cu_seqlens_cpu must be an integer torch.Tensor on the CPU, got list"),
        "cu_seqlens_cpu shape": (dict(cu_seqlens_cpu=torch.tensor([0, 16])), ValueError,
                                 r"cu_seqlens_cpu must have cu_seqlens' shape \(3,\), got \(2,\)"),
        "float cu_seqlens_cpu": (dict(cu_seqlens_cpu=torch.tensor([0.0, 10.0, 16.0])), TypeError,
                                 "cu_seqlens_cpu must have dtype int32 or int64, got torch.float32"),
        "cu_seqlens_cpu short of T": (dict(cu_seqlens_cpu=torch.tensor([0, 10, 15])), ValueError,
                                      "cu_seqlens_cpu must start at 0 and end at T = 16, got first 0 and last 15"),
        "keep_for_backward 1": (dict(keep_for_backward=1), ValueError,
                                r"keep_for_backward must be one of \(True, 'inverse', False\), got 1"),
        "keep_for_backward name": (dict(keep_for_backward="states"), ValueError,
                                   "keep_for_backward must be one of .*got 'states'"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_names_the_argument(case):
    overrides, error, pattern = _bad_cases()[case]
    with pytest.raises(error, match=pattern):
        chunk_gated_delta_rule(**small(**overrides))


def test_host_offsets_are_what_the_kernels_plan_from(monkeypatch):
    """With cu_seqlens_cpu the bounds come from it: cu_seqlens itself is never read back."""
    from flashqla import api

    class NoReadback(torch.Tensor):
        def tolist(self):
            raise AssertionError("cu_seqlens was read back although cu_seqlens_cpu was given")

    inputs = small()
    host = inputs["cu_seqlens"].clone()
    inputs["cu_seqlens"] = inputs["cu_seqlens"].as_subclass(NoReadback)
    assert api.check_inputs(*(inputs[n] for n in ("q", "k", "v", "g", "beta")), None, inputs["initial_state"],
                            inputs["cu_seqlens"], host) == host.tolist()


def test_the_forwards_kept_tensors_reach_the_backward(monkeypatch):
    """By default the backward gets the very tensors the forward made; with keep_for_backward=False
    None; and a forward that autograd will not differentiate keeps nothing (no backward reads it).
    Stand-in kernels, no GPU."""
    from flashqla.hopper import autograd, backward, forward

    made, received, asked = [], [], []

    def fake_forward(q, k, v, *args, keep_for_backward=False, keep_chunk_states=True, **kwargs):
        asked.append(keep_for_backward and (True if keep_chunk_states else "inverse"))
        kept = forward.KeptForward(torch.zeros(4, 1), torch.full((4, 1, 64), 2.0),
                                   torch.ones(1, 1, 8, 8) if keep_chunk_states else None)
        made.append(kept)
        return (v * 1.0, None, kept) if keep_for_backward else (v * 1.0, None)

    def fake_backward(q, k, v, g, beta, scale, h0, cu, d_o, d_state, cu_seqlens_host=None, kept=None,
                      q_rstd=None, k_rstd=None):
        received.append(kept)
        return (torch.zeros_like(q), torch.zeros_like(k), d_o, torch.zeros_like(g), torch.zeros_like(beta), None)

    monkeypatch.setattr(forward, "forward", fake_forward)
    monkeypatch.setattr(backward, "backward", fake_backward)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    g, beta = torch.zeros(1, 4, 1), torch.ones(1, 4, 1)
    for keep in (True, "inverse", False):
        v = torch.randn(1, 4, 1, 8, requires_grad=True)
        o, _ = autograd.chunk_gated_delta_rule_hopper(q, k, v, g, beta, 1.0, None, False, False, None, None, keep)
        o.sum().backward()
    assert isinstance(received[0], forward.KeptForward)
    assert all(a is b for a, b in zip(received[0], made[0]))
    assert received[1].chunk_states is None and all(a is b for a, b in zip(received[1][:2], made[1][:2]))
    assert received[2] is None
    with torch.no_grad():
        autograd.chunk_gated_delta_rule_hopper(q, k, v, g, beta, 1.0, None, False, False, None, None, True)
    autograd.chunk_gated_delta_rule_hopper(q, k, v.detach(), g, beta, 1.0, None, False, False, None, None, True)
    assert asked == [True, "inverse", False, False, False]


def test_saved_inputs_hold_no_larger_base(monkeypatch):
    """The op saves its inputs for the backward as tensors of their own: a v split from the GDN
    layer's fused conv output must not keep all of that output alive (3x v's bytes at Qwen3.5's
    widths). Stand-in kernels, no GPU."""
    from flashqla.hopper import autograd, forward

    monkeypatch.setattr(forward, "forward", lambda q, k, v, *args, **kwargs: (v * 1.0, None))
    qkv = torch.randn(1, 4, 3 * 8, requires_grad=True)
    q, k, v = (x.reshape(1, 4, 1, 8) for x in torch.split(qkv, 8, dim=-1))
    g, beta = torch.zeros(1, 4, 1), torch.ones(1, 4, 1)
    o, _ = autograd.chunk_gated_delta_rule_hopper(q, k, v, g, beta, 1.0, None, False, False, None, None, False)
    saved = [x for x in o.grad_fn.saved_tensors if x is not None]
    base = qkv.untyped_storage().data_ptr()
    assert saved and all(x.untyped_storage().data_ptr() != base for x in saved)


def test_the_l2_norm_reaches_the_walk_and_its_r_the_backward(monkeypatch):
    """With use_qk_l2norm_in_kernel the forward is asked to normalise q and k (its kernels apply the norm's
    r) and the backward gets q, k as given and the r the forward returned; without it, q and k reach both
    as given and no r is passed. Stand-in kernels, no GPU."""
    from flashqla.hopper import autograd, backward, forward

    asked, received = [], []

    def fake_forward(q, k, v, *args, normalize_qk=False, **kwargs):
        asked.append(normalize_qk)
        rows = q.numel() // q.shape[-1]
        rstds = [(torch.full((rows,), 0.5), torch.full((rows,), 0.25))]
        return v * 1.0, None, *(rstds if normalize_qk else [])

    def fake_backward(q, k, v, g, beta, scale, h0, cu, d_o, d_state, cu_seqlens_host=None, kept=None,
                      q_rstd=None, k_rstd=None):
        received.append((q, k, q_rstd, k_rstd))
        return (torch.zeros_like(q), torch.zeros_like(k), d_o, torch.zeros_like(g), torch.zeros_like(beta), None)

    monkeypatch.setattr(forward, "forward", fake_forward)
    monkeypatch.setattr(backward, "backward", fake_backward)
    q, k = torch.randn(1, 4, 1, 8, requires_grad=True), torch.randn(1, 4, 1, 8, requires_grad=True)
    g, beta, v = torch.zeros(1, 4, 1), torch.ones(1, 4, 1), torch.randn(1, 4, 1, 8)
    for l2norm in (True, False):
        o, _ = autograd.chunk_gated_delta_rule_hopper(q, k, v, g, beta, 1.0, None, False, l2norm, None, None, False)
        o.sum().backward()
    assert asked == [True, False]
    (q_saved, k_saved, q_rstd, k_rstd), (q_plain, k_plain, *no_rstds) = received
    assert torch.equal(q_saved, q.detach()) and torch.equal(k_saved, k.detach())
    assert bool((q_rstd == 0.5).all()) and bool((k_rstd == 0.25).all()) and q_rstd.shape == (4,)
    assert torch.equal(q_plain, q.detach()) and torch.equal(k_plain, k.detach()) and no_rstds == [None, None]
