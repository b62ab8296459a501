"""The bench's plumbing on CPU (the timings themselves need a GPU): its inputs, as the anchors and
as the model make them, reach the op with the right flags, and their backward runs."""
import pytest
import torch

from flashqla.bench import (MODEL_SHAPES, _differentiated, _leaves, _output_grads_for, bench_shapes,
                            implementations, make_inputs)


@pytest.mark.parametrize("like_the_model", [False, True], ids=["anchors", "model"])
def test_inputs_reach_the_op_and_differentiate(like_the_model):
    inputs = make_inputs((2, 4), [40, 0, 25], like_the_model=like_the_model, device="cpu")
    assert inputs["use_qk_l2norm_in_kernel"] is like_the_model
    assert (inputs["initial_state"] is None) is like_the_model and inputs["output_final_state"] is not like_the_model
    assert inputs["beta"].dtype == (torch.bfloat16 if like_the_model else torch.float32)
    norms = inputs["q"].float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2) is not like_the_model  # the model normalises in the op
    ours = implementations([], backend="torch")["ours"]
    leaves = _leaves(inputs)
    assert set(leaves) == {"q", "k", "v", "g", "beta"} | (set() if like_the_model else {"initial_state"})
    o, final_state = ours(dict(inputs, **leaves))
    assert (final_state is None) is like_the_model
    outputs = _differentiated(o, final_state)
    torch.autograd.backward(outputs, _output_grads_for(outputs))
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves.values())


def test_the_model_layouts_are_in_the_bench():
    names = [name for name, _, _ in bench_shapes()]
    assert "16/16 1x131072" in names and "8/8 1x131072" in names
    assert len(names) == 35 and "16/32 1x65536" not in names
    assert [name for name, _, _ in MODEL_SHAPES] == ["16/16 1x32768", "16/16 1x131072", "8/8 1x131072",
                                                     "16/32 1x65536"]


@pytest.mark.parametrize("name", ["true", "inverse", "false"])
def test_keep_reaches_our_op_only(monkeypatch, tmp_path, name):
    """--keep NAME is the op's keep_for_backward for ours (True, "inverse", False), and the JSON says which."""
    import json

    import flashqla
    from flashqla.api import KEEP_FOR_BACKWARD
    from flashqla.bench import KEEP_CHOICES, write_json

    assert set(KEEP_CHOICES) == {"true", "inverse", "false"} and list(KEEP_CHOICES.values()) == list(KEEP_FOR_BACKWARD)
    seen = []
    monkeypatch.setattr(flashqla, "chunk_gated_delta_rule", lambda *args, **kwargs: seen.append(kwargs))
    implementations([], keep_for_backward=KEEP_CHOICES[name])["ours"](make_inputs((2, 4), [40], device="cpu"))
    assert seen[0]["keep_for_backward"] is KEEP_CHOICES[name]
    path = tmp_path / "bench.json"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "cpu")
    write_json(path, [], [], {"ours": None}, True, KEEP_CHOICES[name])
    assert json.load(open(path))["keep_for_backward"] == KEEP_CHOICES[name]
