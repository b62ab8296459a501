"""QwenHybridConfig: the architecture values of an HF Qwen3.5 text model, and the named sizes."""
from __future__ import annotations

import dataclasses
from typing import Any

from flashqla.api import KEEP_FOR_BACKWARD as GDN_KEEP_FOR_BACKWARD, is_keep_for_backward
from qwen_hybrid.attention import ATTENTION_BACKENDS

LAYER_TYPES = ("linear_attention", "full_attention")
GDN_BACKENDS = ("auto", "tilelang", "torch", "fla")
CONV_BACKENDS = ("auto", "tilelang", "torch")  # flashqla.conv
QWEN3_5_VOCAB_SIZE = 248320
# fields that choose implementations, not architecture: never read from an HF config.json
IMPLEMENTATION_FIELDS = ("gdn_backend", "conv_backend", "attention_backend", "gdn_keep_for_backward")


@dataclasses.dataclass
class QwenHybridConfig:
    """Every value of HF's `Qwen3_5TextConfig` that the dense architecture uses, under HF's names.

    `layer_types[i]` is "linear_attention" (Gated DeltaNet) or "full_attention" (gated softmax
    attention); `full_attention_interval` only fills `layer_types` when that is not given.
    """

    vocab_size: int = QWEN3_5_VOCAB_SIZE
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # ours, not HF's: which implementations the GDN layers call for the gated delta rule and the conv,
    # and the attention layers for softmax attention (qwen_hybrid.attention)
    gdn_backend: str = "auto"
    conv_backend: str = "auto"
    attention_backend: str = "auto"
    gdn_keep_for_backward: bool | str = "inverse"  # flashqla.chunk_gated_delta_rule's keep_for_backward (configs/model/*.yaml say why)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            if self.full_attention_interval < 1:
                raise ValueError(f"full_attention_interval must be >= 1, got {self.full_attention_interval}")
            self.layer_types = [
                "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = list(self.layer_types)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for any inconsistent value."""
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] must be one of {LAYER_TYPES}, got {layer_type!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
            raise ValueError(
                f"head_dim * partial_rotary_factor = {self.head_dim} * {self.partial_rotary_factor} must give a "
                f"positive even rotary dim, got {self.rotary_dim}"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.gdn_backend not in GDN_BACKENDS:
            raise ValueError(f"gdn_backend must be one of {GDN_BACKENDS}, got {self.gdn_backend!r}")
        if self.conv_backend not in CONV_BACKENDS:
            raise ValueError(f"conv_backend must be one of {CONV_BACKENDS}, got {self.conv_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not is_keep_for_backward(self.gdn_keep_for_backward):
            raise ValueError(f"gdn_keep_for_backward must be one of {GDN_KEEP_FOR_BACKWARD}, "
                             f"got {self.gdn_keep_for_backward!r}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def named(cls, size: str, **overrides: Any) -> "QwenHybridConfig":
        """A named size: "tiny" (tests, CPU) or a dense Qwen3.5 model ("0.8B", "2B", "4B", "9B", "27B")."""
        if size not in NAMED_SIZES:
            raise ValueError(f"size must be one of {sorted(NAMED_SIZES)}, got {size!r}")
        return cls(**{**NAMED_SIZES[size], **overrides})

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], **overrides: Any) -> "QwenHybridConfig":
        """From an HF config.json dict: a `qwen3_5_text` config, or a full `qwen3_5` one whose
        `text_config` holds the text tower. Mixture-of-experts configs are refused."""
        if not isinstance(hf_config, dict):
            raise TypeError(f"hf_config must be a dict (a parsed config.json), got {type(hf_config).__name__}")
        text = hf_config
        if "text_config" in hf_config:
            text = dict(hf_config["text_config"] or {})
            # the full checkpoint keeps tie_word_embeddings at the top, where HF's model reads it
            if "tie_word_embeddings" in hf_config:
                text["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
        model_type = text.get("model_type", hf_config.get("model_type", ""))
        if "moe" in str(model_type) or text.get("num_experts") or text.get("num_experts_per_tok"):
            raise ValueError(
                f"mixture-of-experts Qwen3.5 checkpoints are not supported yet (model_type={model_type!r}, "
                f"num_experts={text.get('num_experts')}); only the dense sizes load"
            )
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {text['hidden_act']!r}")
        if text.get("attention_bias", False):
            raise ValueError("attention_bias=True is not supported: Qwen3.5 attention projections have no bias")
        if text.get("attn_output_gate", True) is not True:
            raise ValueError("attn_output_gate must be true: the attention block always applies the output gate")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type must be 'default', got {rope_type!r} (rope scaling unsupported)")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in text and field.name not in ("rope_theta", "partial_rotary_factor", *IMPLEMENTATION_FIELDS):
                values[field.name] = text[field.name]
        values["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0)))
        values["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        )
        values.update(overrides)
        return cls(**values)

    def to_hf(self) -> dict[str, Any]:
        """An HF `Qwen3_5TextConfig` dict (config.json of a `Qwen3_5ForCausalLM` checkpoint)."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attention_bias": False,
            "attn_output_gate": True,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "partial_rotary_factor": self.partial_rotary_factor,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


# The dense Qwen3.5 family, from the released config.json files (text_config) as quoted in public
# code. Shared by all five: vocab 248320, head_dim 256, linear key/value head dims 128, conv
# kernel 4, rope_theta 1e7, partial_rotary_factor 0.25, every 4th layer full attention,
# rms_norm_eps 1e-6, max_position_embeddings 262144, eos_token_id 248044.
_QWEN3_5_SHARED = dict(
    vocab_size=QWEN3_5_VOCAB_SIZE, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, rope_theta=10_000_000.0, partial_rotary_factor=0.25, full_attention_interval=4,
    rms_norm_eps=1e-6, max_position_embeddings=262144, eos_token_id=248044,
)
NAMED_SIZES: dict[str, dict[str, Any]] = {
    # Two GDN and two attention layers, grouped heads in both: for tests and CPU runs.
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0,
        partial_rotary_factor=0.25, max_position_embeddings=4096, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
    ),
    "0.8B": dict(
        _QWEN3_5_SHARED, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
    ),
    # tie_word_embeddings for 2B not seen in a quoted config.json; True like the other small sizes.
    "2B": dict(
        _QWEN3_5_SHARED, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
    ),
    # tie_word_embeddings for 4B not seen in a quoted config.json; True like the other small sizes.
    "4B": dict(
        _QWEN3_5_SHARED, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True,
    ),
    # 9B: HF's Qwen3_5TextConfig defaults, which its docstring calls "Qwen3.5-9B style"; no
    # config.json of the released 9B was found to confirm them.
    "9B": dict(
        _QWEN3_5_SHARED, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False,
    ),
    "27B": dict(
        _QWEN3_5_SHARED, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48, tie_word_embeddings=False,
    ),
}
