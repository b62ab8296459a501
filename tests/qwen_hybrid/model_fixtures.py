"""A tiny random HF Qwen3_5ForCausalLM saved to disk, for the model and checkpoint tests."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 256


def tiny_hf_config(tie_word_embeddings: bool = False, **overrides):
    """Both layer types twice, grouped heads in both (GDN 2 qk / 4 v heads, attention 4 q / 2 kv)."""
    values = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=512,
    )
    values.update(overrides)
    return transformers.Qwen3_5TextConfig(**values)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random (norm weights too, which HF initialises to constants), small enough
    that 4 layers stay well conditioned; A_log keeps the decay in a realistic range."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(-2.0, 1.0, generator=generator))
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif param.dim() == 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.08)


def make_tiny_hf_model(tie_word_embeddings: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(tiny_hf_config(tie_word_embeddings)).float().eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="module")
def tiny_hf_checkpoint(tmp_path_factory):
    """(directory, HF model) for an untied tiny model saved with save_pretrained."""
    model = make_tiny_hf_model()
    directory = tmp_path_factory.mktemp("tiny_qwen3_5")
    model.save_pretrained(directory)
    return directory, model
