"""The pieces of the step's bookkeeping that need no training run: the FLOP count, metrics.jsonl
reading, and the divergence guard."""
import math

import pytest

from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from train.metrics import matmul_parameters, read_records, training_flops
from train.pretrain import DivergenceGuard


@pytest.mark.parametrize("tie", [True, False])
def test_flop_count_is_6NT_plus_causal_attention_per_document(tie):
    config = QwenHybridConfig.named("tiny", tie_word_embeddings=tie)
    model = QwenHybridForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    params = matmul_parameters(total, config)
    # the LM head's matmul is counted once, the embedding lookup not at all
    assert params == sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name) + (
        embedding if tie else 0)
    attention_layers = config.layer_types.count("full_attention")
    assert attention_layers > 0
    per_square = 6 * config.num_attention_heads * config.head_dim * attention_layers
    assert training_flops(params, config, [100]) == 6 * params * 100 + per_square * 100**2
    # packing two documents halves the attention term of one of twice the length, not 6NT
    one, two = training_flops(params, config, [200]), training_flops(params, config, [100, 100])
    assert one - two == per_square * (200**2 - 2 * 100**2)
    assert training_flops(params, config, [100, 0, 100]) == two


def test_read_records_drops_a_torn_line_and_names_it(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 6.0}\n{"step": 2, "loss": NaN}\n{"step": 3, "lo')
    with caplog.at_level("WARNING", logger="train"):
        records = read_records(path)
    assert [r["step"] for r in records] == [1, 2] and math.isnan(records[1]["loss"])
    assert f"{path}: line 3 is not JSON" in caplog.text


def test_divergence_guard_counts_only_consecutive_bad_steps():
    guard = DivergenceGuard(max_bad_steps=2)
    assert not guard.observe(1, 6.0, 1.0, skipped=False)
    assert guard.observe(2, float("nan"), 1.0, skipped=False) and guard.in_bad_streak and not guard.diverged
    assert not guard.observe(3, 5.0, 1.0, skipped=False) and not guard.in_bad_streak  # recovered: the count restarts
    assert guard.observe(4, 5.0, float("inf"), skipped=False)
    assert guard.observe(5, 5.0, 1.0, skipped=True) and guard.diverged and guard.streak == [4, 5]
