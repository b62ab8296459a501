"""Our model against HF transformers' Qwen3_5ForCausalLM from the same checkpoint, and checkpoint IO."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashqla.testing import relative_error
from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from qwen_hybrid import checkpoint_io
from qwen_hybrid.checkpoint_io import INDEX_FILE

from model_fixtures import VOCAB_SIZE, make_tiny_hf_model, tiny_hf_checkpoint, tiny_hf_config, transformers  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]


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


# --- saving is crash-safe, loading refuses damaged checkpoints ---

SMALL_SHARDS = 64 * 1024  # several files and an index for the tiny model


def _assert_same_weights(directory, expected: QwenHybridForCausalLM):
    reloaded = load_ours(directory).state_dict()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name


def _save_with(saver: str, model, directory, **kwargs):
    if saver == "save_pretrained":
        model.save_pretrained(directory, **kwargs)
    else:
        from qwen_hybrid.parallel import ParallelGroups, save_hf_checkpoint

        single = ParallelGroups(tp_group=None, dp_group=None, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
        save_hf_checkpoint(model, single, directory, **kwargs)


@pytest.mark.parametrize("saver", ["save_pretrained", "save_hf_checkpoint"])
def test_a_crash_mid_save_leaves_the_old_checkpoint_complete(tiny_hf_checkpoint, tmp_path, monkeypatch, saver):
    old = load_ours(tiny_hf_checkpoint[0])
    directory = tmp_path / "hf_final"
    _save_with(saver, old, directory, max_shard_bytes=SMALL_SHARDS)
    (directory / "tokenizer.json").write_text("{}")
    new = load_ours(tiny_hf_checkpoint[0])
    with torch.no_grad():
        for param in new.parameters():
            param.add_(1.0)

    written = []
    real_save_file = checkpoint_io.save_file

    def crash_after_first_shard(tensors, file, metadata=None):
        if written:
            raise OSError("simulated crash: disk full")
        real_save_file(tensors, file, metadata=metadata)
        written.append(Path(file))

    monkeypatch.setattr(checkpoint_io, "save_file", crash_after_first_shard)
    with pytest.raises(OSError, match="simulated crash"):
        _save_with(saver, new, directory, max_shard_bytes=SMALL_SHARDS)
    _assert_same_weights(directory, old)
    transformers.Qwen3_5ForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert len(written) == 1 and written[0].parent != directory  # the first shard went elsewhere
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_final"]  # no .partial / .previous left

    monkeypatch.undo()
    _save_with(saver, new, directory)  # one file now: the old shards and index must not linger
    _assert_same_weights(directory, new)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_final"]


def test_a_save_killed_between_its_renames_is_recovered(tiny_hf_checkpoint, tmp_path):
    model = load_ours(tiny_hf_checkpoint[0])
    directory = tmp_path / "out"
    model.save_pretrained(directory)
    # the state a kill between "rename old aside" and "rename new in" leaves, plus a stale .partial
    directory.rename(tmp_path / "out.previous")
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(FileNotFoundError, match=r"out\.previous holds the checkpoint of an interrupted save"):
        load_ours(directory)
    model.save_pretrained(directory)
    _assert_same_weights(directory, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_hf_loads_our_sharded_save(tmp_path, tie_word_embeddings):
    hf = make_tiny_hf_model(tie_word_embeddings=tie_word_embeddings, seed=7)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_ours(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours", max_shard_bytes=SMALL_SHARDS)
    index = json.loads((tmp_path / "ours" / INDEX_FILE).read_text())
    assert ("lm_head.weight" in index["weight_map"]) is not tie_word_embeddings
    again = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    if tie_word_embeddings:
        assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    input_ids = random_ids(1, 21, seed=8)
    with torch.no_grad():
        assert torch.equal(again(input_ids).logits, hf(input_ids).logits)


@pytest.fixture
def sharded_checkpoint(tiny_hf_checkpoint, tmp_path):
    directory = tmp_path / "sharded"
    load_ours(tiny_hf_checkpoint[0]).save_pretrained(directory, max_shard_bytes=SMALL_SHARDS)
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    return directory, weight_map


def test_a_tensor_in_two_shards_is_refused_naming_both_files(sharded_checkpoint):
    directory, weight_map = sharded_checkpoint
    first, second = sorted(set(weight_map.values()))[:2]
    stray = next(name for name, file in weight_map.items() if file == second)
    tensors = load_file(str(directory / first))
    tensors[stray] = load_file(str(directory / second))[stray]
    save_file(tensors, str(directory / first), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(stray)} twice: in .*{first} and in .*{second}"):
        load_ours(directory)


def test_a_truncated_shard_is_named(sharded_checkpoint):
    directory, weight_map = sharded_checkpoint
    shard = directory / sorted(set(weight_map.values()))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{re.escape(str(shard))} is not a readable safetensors file.*"
                                         rf"has {len(data) - 100} bytes, but its header describes {len(data)}"):
        load_ours(directory)
    shard.write_bytes(data[:5])
    with pytest.raises(ValueError, match=rf"{re.escape(str(shard))} .*expected at least 8"):
        load_ours(directory)


def test_an_index_naming_a_missing_shard_is_named(sharded_checkpoint):
    directory, weight_map = sharded_checkpoint
    missing = sorted(set(weight_map.values()))[-1]
    (directory / missing).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{INDEX_FILE} names shard {missing} .*does not exist"):
        load_ours(directory)


def _run_benchmark(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.model_vs_hf", *args], cwd=REPO_ROOT, capture_output=True, text=True,
        env={**os.environ, **env}, timeout=300,
    )


def test_benchmark_help_prints_usage():
    result = _run_benchmark("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m benchmarks.model_vs_hf")


def test_benchmark_without_cuda_says_so_in_one_line():
    result = _run_benchmark('[{"size": "0.8B", "tokens": 64}]', CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "benchmarks.model_vs_hf: needs a CUDA GPU (torch.cuda.is_available() is False)"
    ]


def test_model_vs_hf_prints_each_case_against_the_first():
    from benchmarks.model_vs_hf import comparison_lines

    case = dict(size="0.8B", tokens=16384, backend="auto")
    results = [dict(case, impl="ours", step_ms=400.0, peak_gib=35.0),
               dict(case, impl="hf", hf_gdn="fla", step_ms=480.0, peak_gib=91.0),
               dict(case, impl="hf", hf_gdn="flashqla", tokens=32768, error="out of memory: 30 GiB")]
    assert comparison_lines(results) == [
        "against case 1 (ours 0.8B 16384 tokens, backend auto: 400.0 ms, 35.0 GiB):",
        "  case 2 (hf 0.8B 16384 tokens, GDN by fla): step 1.20x, peak memory 2.60x",
        "  case 3 (hf 0.8B 32768 tokens, GDN by flashqla): out of memory: 30 GiB",
    ]
    assert comparison_lines(results[:1]) == []


def test_model_vs_hf_sets_flas_handover_for_the_case_only(monkeypatch):
    import os

    from benchmarks import model_vs_hf

    seen = []
    monkeypatch.setattr(model_vs_hf, "_measure", lambda *args: seen.append(os.environ.get("FLA_FLASH_QLA")) or {})
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    model_vs_hf.measure(impl="hf", hf_gdn="flashqla")
    model_vs_hf.measure(impl="hf")
    model_vs_hf.measure(impl="ours")
    assert seen == ["1", "0", None] and "FLA_FLASH_QLA" not in os.environ
    with pytest.raises(ValueError, match="hf_gdn must be one of"):
        model_vs_hf.measure(impl="hf", hf_gdn="triton")
