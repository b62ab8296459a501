"""Our model against HF transformers' Qwen3_5ForCausalLM from the same checkpoint, and checkpoint IO."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashqla.testing import relative_error
from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from qwen_hybrid.checkpoint_io import INDEX_FILE

from model_fixtures import VOCAB_SIZE, make_tiny_hf_model, tiny_hf_checkpoint, tiny_hf_config, transformers  # noqa: F401


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def load_ours(directory) -> QwenHybridForCausalLM:
    return QwenHybridForCausalLM.from_pretrained(directory, dtype=torch.float32, gdn_backend="torch").eval()


def assert_matches_hf(ours, hf, input_ids, labels):
    """Logits, loss and every parameter gradient of ours equal HF's (float32, relative L2)."""
    hf.zero_grad()
    ours.zero_grad()
    expected = hf(input_ids, labels=labels)
    expected.loss.backward()
    actual = ours(input_ids, labels=labels, return_logits=True)
    actual.loss.backward()

    assert relative_error(actual.logits, expected.logits) <= 1e-4
    assert abs(actual.loss.item() - expected.loss.item()) <= 1e-5 * abs(expected.loss.item())
    hf_params = dict(hf.named_parameters())
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == set(hf_params)
    for name, param in ours_params.items():
        expected_grad = hf_params[name].grad
        assert expected_grad is not None and expected_grad.norm() > 0, name
        assert relative_error(param.grad, expected_grad) <= 1e-4, (name, relative_error(param.grad, expected_grad))


def test_logits_loss_and_every_gradient_match_hf(tiny_hf_checkpoint):
    directory, hf = tiny_hf_checkpoint
    ours = load_ours(directory)
    # 70 tokens: more than one 64-token chunk of the gated delta rule; some labels ignored
    input_ids = random_ids(2, 70)
    labels = input_ids.clone()
    labels[0, 10:20] = -100
    assert_matches_hf(ours, hf, input_ids, labels)


def test_tied_embeddings_match_hf(tmp_path):
    hf = make_tiny_hf_model(tie_word_embeddings=True, seed=3)
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    input_ids = random_ids(1, 40, seed=4)
    assert_matches_hf(ours, hf, input_ids, input_ids)


def test_save_and_reload_round_trip_is_exact(tiny_hf_checkpoint, tmp_path):
    ours = load_ours(tiny_hf_checkpoint[0])
    ours.save_pretrained(tmp_path / "single")
    # a small shard limit forces several files and an index, as large checkpoints have
    ours.save_pretrained(tmp_path / "sharded", max_shard_bytes=64 * 1024)
    assert (tmp_path / "sharded" / INDEX_FILE).is_file()
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    for directory in (tmp_path / "single", tmp_path / "sharded"):
        reloaded = load_ours(directory)
        assert reloaded.config == ours.config
        original, again = ours.state_dict(), reloaded.state_dict()
        assert original.keys() == again.keys()
        for name in original:
            assert torch.equal(original[name], again[name]), name


def test_hf_loads_what_we_save_and_matches(tiny_hf_checkpoint, tmp_path):
    ours = load_ours(tiny_hf_checkpoint[0])
    ours.save_pretrained(tmp_path)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    input_ids = random_ids(2, 33, seed=5)
    with torch.no_grad():
        assert relative_error(ours(input_ids).logits, hf(input_ids).logits) <= 1e-4


def test_text_tower_of_the_full_multimodal_checkpoint_loads(tiny_hf_checkpoint, tmp_path):
    directory, hf = tiny_hf_checkpoint
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    full = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=tiny_hf_config().to_dict(), vision_config=vision)
    )
    full.model.language_model.load_state_dict(hf.model.state_dict())
    full.lm_head.load_state_dict(hf.lm_head.state_dict())
    full.save_pretrained(tmp_path)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())

    ours = load_ours(tmp_path)
    input_ids = random_ids(1, 25, seed=6)
    with torch.no_grad():
        assert relative_error(ours(input_ids).logits, hf(input_ids).logits) <= 1e-4


def _copy_checkpoint(source, destination, edit_tensors=None, edit_config=None):
    destination.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_missing_tensor_is_named(tiny_hf_checkpoint, tmp_path):
    name = "model.layers.2.linear_attn.A_log"
    bad = _copy_checkpoint(tiny_hf_checkpoint[0], tmp_path / "bad", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_ours(bad)


def test_shape_mismatch_is_named(tiny_hf_checkpoint, tmp_path):
    def widen(config):
        config["intermediate_size"] = 128

    bad = _copy_checkpoint(tiny_hf_checkpoint[0], tmp_path / "bad", edit_config=widen)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*shape"):
        load_ours(bad)


def test_unexpected_tensor_is_named(tiny_hf_checkpoint, tmp_path):
    def add_layer_tensor(tensors):
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)

    bad = _copy_checkpoint(tiny_hf_checkpoint[0], tmp_path / "bad", edit_tensors=add_layer_tensor)
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_ours(bad)


def test_mixture_of_experts_checkpoint_is_refused():
    moe = {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": 256}}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        QwenHybridConfig.from_hf(moe)


def test_config_round_trips_through_hf():
    config = QwenHybridConfig.from_hf(tiny_hf_config().to_dict())
    assert config.layer_types == ["linear_attention", "full_attention"] * 2
    assert config.rotary_dim == 16 and config.linear_num_value_heads == 4
    assert QwenHybridConfig.from_hf(config.to_hf()) == config
    hf_again = transformers.Qwen3_5TextConfig(**config.to_hf())
    assert hf_again.layer_types == config.layer_types
    assert hf_again.rope_parameters["partial_rotary_factor"] == config.partial_rotary_factor
