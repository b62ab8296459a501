"""A Qwen3.5-style hybrid (Gated DeltaNet + gated attention) causal LM that loads and saves HF
`Qwen3_5ForCausalLM` checkpoints."""
from qwen_hybrid.config import QwenHybridConfig
from qwen_hybrid.model import QwenHybridForCausalLM

__all__ = ["QwenHybridConfig", "QwenHybridForCausalLM"]
