"""The switch between verified kernels and candidates (flashqla/hopper/candidates.py): off unless asked,
scoped, validated; the autograd Function hands its forward's choice to its backward."""
import pytest

from flashqla.hopper import candidates


@pytest.fixture(autouse=True)
def two_candidates(monkeypatch):
    """The switch's behaviour does not depend on which candidates are in the tree today."""
    monkeypatch.setattr(candidates, "NAMES", ("forward_candidate", "backward_candidate"))


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(candidates.ENV_VAR, raising=False)
    assert candidates.chosen() == ()
    assert not any(candidates.enabled(name) for name in candidates.NAMES)


def test_environment_turns_candidates_on(monkeypatch):
    monkeypatch.setenv(candidates.ENV_VAR, " forward_candidate, ")
    assert candidates.enabled("forward_candidate")
    assert not candidates.enabled("backward_candidate")


def test_unknown_name_in_environment_is_named(monkeypatch):
    monkeypatch.setenv(candidates.ENV_VAR, "forward_candidate,fastest")
    with pytest.raises(ValueError, match=r"FLASHQLA_CANDIDATES.*'fastest'.*forward_candidate"):
        candidates.chosen()


def test_use_scopes_and_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(candidates.ENV_VAR, "forward_candidate")
    with candidates.use("backward_candidate"):
        assert candidates.chosen() == ("backward_candidate",)
        with candidates.use():
            assert candidates.chosen() == ()
        assert candidates.chosen() == ("backward_candidate",)
    assert candidates.chosen() == ("forward_candidate",)
    with pytest.raises(ValueError, match="'nope'"):
        with candidates.use("nope"):
            pass


def test_backward_runs_the_kernels_its_forward_chose(monkeypatch):
    """Stand-in kernels record what candidates were on when each ran (no GPU needed)."""
    import torch

    from flashqla import api, hopper
    from flashqla.hopper import backward as backward_module

    seen = {}

    def fake_forward(q, k, v, *args, **kwargs):
        seen["forward"] = candidates.chosen()
        return v * 1.0, None

    def fake_backward(q, k, v, g, beta, scale, h0, cu, d_o, d_state, cu_seqlens_host=None, kept=None):
        seen["backward"] = candidates.chosen()
        return (torch.zeros_like(q), torch.zeros_like(k), d_o, torch.zeros_like(g), torch.zeros_like(beta), None)

    monkeypatch.setattr(hopper, "forward", fake_forward)
    monkeypatch.setattr(backward_module, "backward", fake_backward)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    v = torch.randn(1, 4, 1, 8, requires_grad=True)
    g, beta = torch.zeros(1, 4, 1), torch.ones(1, 4, 1)
    with candidates.use("backward_candidate"):
        o, _ = api.HopperGatedDeltaRule.apply(q, k, v, g, beta, 1.0, None, False, None, None)
    o.sum().backward()  # outside the block: must still run the forward's choice
    assert seen == {"forward": ("backward_candidate",), "backward": ("backward_candidate",)}
    assert torch.equal(v.grad, torch.ones_like(v))
