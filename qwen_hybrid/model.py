"""QwenHybridForCausalLM: the Qwen3.5 hybrid decoder (Gated DeltaNet + gated attention) with a
chunked-vocabulary loss, packed-sequence support and HF checkpoint loading/saving."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qwen_hybrid import checkpoint_io
from qwen_hybrid.config import GDN_BACKENDS, QwenHybridConfig
from qwen_hybrid.layers import DecoderLayer, DocumentLayout, RMSNorm
from qwen_hybrid.loss import DEFAULT_CHUNK_SIZE, IGNORE_INDEX, chunked_cross_entropy


@dataclasses.dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class QwenHybridModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix).

    `sequence_shards`: into how many contiguous equal slices the packed sequence is split, one a
    forward (context parallelism; the token mixers' `head_exchange` assembles the whole sequence).
    1 unless `qwen_hybrid.parallel.apply_context_parallel` set it; then cu_seqlens covers the whole
    sequence and position_ids must be given (the slice's positions in their documents)."""

    def __init__(self, config: QwenHybridConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.sequence_shards = 1

    def forward(self, input_ids, cu_seqlens=None, position_ids=None, cu_seqlens_cpu=None) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, H]. cu_seqlens may be on the CPU (moved here);
        cu_seqlens_cpu, its host copy, spares the device->host read (the layers read neither: they
        get the DocumentLayout built here once)."""
        batch, length = input_ids.shape
        if position_ids is None and self.sequence_shards > 1:
            raise ValueError(_SLICE_NEEDS_POSITIONS.format(shards=self.sequence_shards))
        documents = None if cu_seqlens is None else DocumentLayout.build(cu_seqlens, input_ids.device, cu_seqlens_cpu)
        cos = sin = None
        if "full_attention" in self.config.layer_types:
            if position_ids is None:
                positions = torch.arange(length, device=input_ids.device) if documents is None else documents.position_in_doc
                position_ids = positions.expand(batch, length)
            cos, sin = _rotary_tables(position_ids, self.config.rotary_dim, self.config.rope_theta)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            if layer.checkpointed and torch.is_grad_enabled() and not layer.checkpoints_itself:
                hidden = checkpoint(layer, hidden, cos, sin, documents, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, documents)
        return self.norm(hidden)


class LMHead(nn.Linear):
    """The vocabulary projection. Its forward also computes the chunked loss, so that ZeRO-3's
    module hooks gather the weight for the loss as they do for the logits."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE):
        """hidden [..., H] -> logits [..., V]; with labels ([T], hidden [T, H]) -> mean loss instead."""
        if labels is None:
            return F.linear(hidden, self.weight)
        return chunked_cross_entropy(hidden, self.weight, labels, chunk_size=chunk_size)


_SLICE_NEEDS_POSITIONS = (
    "position_ids: none given, but this model sees one of {shards} slices of the sequence (context "
    "parallelism) and cannot tell where its slice starts; pass the slice's positions "
    "(qwen_hybrid.parallel.context_parallel_slice builds them)"
)


class QwenHybridForCausalLM(nn.Module):
    def __init__(self, config: QwenHybridConfig):
        super().__init__()
        self.config = config
        self.model = QwenHybridModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.loss_chunk_size = DEFAULT_CHUNK_SIZE
        # what this rank holds when `qwen_hybrid.parallel.shard_model` split it (None: whole)
        self.tensor_parallel_plan = None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    def set_activation_checkpointing(self, enabled: bool, recompute_attention: bool = True,
                                     layers: int | None = None) -> None:
        """Recompute decoder layers in the backward instead of keeping their activations.
        layers: how many, the first ones (None: all); the others keep everything, which spends
        memory the card has on recomputation it saves (0.8B: ~2.3 GB a layer per 32768 tokens).
        recompute_attention=False: checkpointed attention layers keep the attention kernel's inputs
        and outputs (q, k, v, output and its log-sum-exp), the output gate, and their input and its
        norm (whole sequence of tokens even under sequence parallelism): about
        T * (4 H + 2 Hkv) * d * 2 + 3 T * hidden * 2 bytes a layer (+13.8 GiB for 0.8B at 131072
        tokens on the H200), and recompute only their projections, norms and MLP, so the backward
        runs no attention forward."""
        count = len(self.model.layers)
        if layers is not None and not (isinstance(layers, int) and 0 <= layers <= count):
            raise ValueError(f"layers must be None or an integer in [0, {count}], got {layers!r}")
        checkpointed = count if layers is None else layers
        for index, layer in enumerate(self.model.layers):
            layer.checkpointed = bool(enabled) and index < checkpointed
            if layer.layer_type == "full_attention":  # keep_attention_tensors sets the checkpointed ones
                layer.self_attn.checkpoint_around_attention = False
        self.keep_attention_tensors(0 if recompute_attention else len(self.checkpointed_attention()))

    def checkpointed_attention(self) -> list:
        """The attention modules of the checkpointed layers, first to last."""
        return [layer.self_attn for layer in self.model.layers
                if layer.layer_type == "full_attention" and layer.checkpointed]

    def keep_attention_tensors(self, layers: int) -> None:
        """From the next forward on, the first `layers` checkpointed attention layers keep the attention
        kernel's tensors (what recompute_attention=False does for all of them) and the others recompute
        them. train.recompute_attention=auto calls this after the second step, with as many as fit."""
        attention = self.checkpointed_attention()
        if not (isinstance(layers, int) and 0 <= layers <= len(attention)):
            raise ValueError(f"layers must be an integer in [0, {len(attention)}] (the checkpointed attention "
                             f"layers), got {layers!r}")
        for index, module in enumerate(attention):
            module.checkpoint_around_attention = index < layers

    def kept_attention_layers(self) -> int:
        """How many checkpointed attention layers keep the attention kernel's tensors now."""
        return sum(module.checkpoint_around_attention for module in self.checkpointed_attention())

    def kept_attention_bytes(self, tokens: int) -> int:
        """Bytes one checkpointed attention layer of this rank keeps on top of recomputing when it keeps
        the attention kernel's tensors, for a row of `tokens` tokens: T * 6 H * d + 3 T * hidden elements
        in the model's dtype, with this rank's heads. That is set_activation_checkpointing's estimate
        with k and v counted at the query heads, as a kernel without GQA keeps them (varlen_causal's
        repeat), so that it bounds every attention path from above: 3.75 GiB a layer for 0.8B at 131072
        tokens, where keeping all six measured 13.8 GiB (2.3 a layer) on the H200."""
        attention = next(layer.self_attn for layer in self.model.layers if layer.layer_type == "full_attention")
        elements = tokens * (6 * attention.num_heads * attention.head_dim + 3 * self.config.hidden_size)
        return elements * attention.o_proj.weight.element_size()

    def set_gdn_backend(self, backend: str) -> None:
        """Run the gated delta rule of every GDN layer on `backend` from the next forward on (the
        config's gdn_backend; a benchmark alternating backends step by step calls this)."""
        if backend not in GDN_BACKENDS:
            raise ValueError(f"backend must be one of {GDN_BACKENDS}, got {backend!r}")
        self.config.gdn_backend = backend
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.gated_delta_rule.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
        targets: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T]. cu_seqlens [N+1] (B = 1): packed documents, each independent in every
        layer; on the CPU or the model's device (read back to the host once per call).
        position_ids [B, T]: RoPE positions (default: 0.. per row, or per document).
        labels [B, T] aligned with input_ids like HF's (the model shifts them; -100 ignored;
        no target crosses a document boundary). targets [B, T], instead of labels: already
        shifted, targets[b, t] is the token position t must predict (-100: none).
        return_logits defaults to `labels is None and targets is None`.

        Under context parallelism (`model.sequence_shards` > 1) input_ids is this rank's slice,
        cu_seqlens covers the whole sequence, and position_ids and targets are required: shifting
        labels within a slice would lose its last token's target, which is the next slice's first
        token (`qwen_hybrid.parallel.context_parallel_slice` builds all three)."""
        cu_seqlens_cpu = None
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor):
                raise TypeError(f"cu_seqlens must be an integer torch.Tensor [N+1], got {type(cu_seqlens).__name__}")
            cu_seqlens_cpu = cu_seqlens.cpu()  # the forward's one device->host read (none from the CPU)
        _check_inputs(input_ids, cu_seqlens_cpu, position_ids, labels, targets, self.model.sequence_shards)
        hidden = self.model(input_ids, cu_seqlens, position_ids, cu_seqlens_cpu)
        if return_logits is None:
            return_logits = labels is None and targets is None
        output = CausalLMOutput()
        if labels is not None:
            targets = shift_labels(labels, cu_seqlens_cpu)
        if targets is not None:
            output.loss = self.lm_head(
                hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), chunk_size=self.loss_chunk_size
            )
        if return_logits:
            output.logits = self.lm_head(hidden)
        return output

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **config_overrides,
    ) -> "QwenHybridForCausalLM":
        """Load an HF Qwen3.5 directory (config.json + safetensors, sharded or not; text-only or the
        text tower of the full multimodal checkpoint). dtype None keeps the stored dtypes.
        config_overrides (e.g. gdn_backend="torch") replace config values."""
        hf_config = checkpoint_io.read_config(path)
        config = QwenHybridConfig.from_hf(hf_config, **config_overrides)
        with torch.device("meta"):
            model = cls(config)
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        checkpoint_io.load_into(model, path, expected, dtype=dtype, device=device)
        return model

    def save_pretrained(self, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3) -> None:
        """Write config.json + safetensors that `transformers.Qwen3_5ForCausalLM.from_pretrained` loads."""
        if self.tensor_parallel_plan is not None:
            # this rank holds only its heads' slices: writing them would give a checkpoint nothing loads
            raise ValueError(
                f"save_pretrained: this model is tensor-parallel sharded (tp = {self.tensor_parallel_plan.tp_size}); "
                "use qwen_hybrid.parallel.save_hf_checkpoint(model, groups, path), which gathers the shards"
            )
        checkpoint_io.save(path, self.config, self.state_dict(), max_shard_bytes=max_shard_bytes)


def shift_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Targets for next-token prediction: position t is scored against labels[t + 1]; the last
    position of each row, and with cu_seqlens the last token of each document, get none."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        # picked where cu_seqlens lives: on the host this costs no device synchronisation
        last_tokens = cu_seqlens[1:].to(torch.long) - 1
        targets[0, last_tokens[last_tokens >= 0].to(targets.device, non_blocking=True)] = IGNORE_INDEX
    return targets


def _rotary_tables(position_ids: torch.Tensor, rotary_dim: int, theta: float):
    """cos, sin [B, T, rotary_dim] float32 for the rotate-half layout (HF's default RoPE; Qwen3.5's
    interleaved M-RoPE equals it when all three position streams hold the text positions)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=position_ids.device) / rotary_dim)
    )
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _check_inputs(input_ids, cu_seqlens, position_ids, labels, targets=None, sequence_shards=1) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [B, T] tensor, got {shape}")
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids must be int32 or int64, got {input_ids.dtype}")
    batch, length = input_ids.shape
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs input_ids with B = 1 (documents packed in one row), got B = {batch}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [N+1], got shape {tuple(cu_seqlens.shape)}, "
                f"dtype {cu_seqlens.dtype}"
            )
        bounds = cu_seqlens.tolist()
        whole = length * sequence_shards
        end = f"T = {length}" if sequence_shards == 1 else f"the whole sequence's {sequence_shards} x T = {whole}"
        if bounds[0] != 0 or bounds[-1] != whole or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(
                f"cu_seqlens must start at 0, end at {end} and not decrease, got {bounds[:8]}"
                f"{'...' if len(bounds) > 8 else ''}"
            )
    if labels is not None and targets is not None:
        raise ValueError("labels and targets were both given; pass labels (the model shifts them) or targets, not both")
    if sequence_shards > 1:
        if labels is not None:
            raise ValueError(
                f"labels: this model sees one of {sequence_shards} slices of the sequence (context parallelism), "
                "where shifting labels would lose the target of the slice's last token; pass targets, the "
                "slice's next-token targets (qwen_hybrid.parallel.context_parallel_slice builds them)"
            )
        if position_ids is None:
            raise ValueError(_SLICE_NEEDS_POSITIONS.format(shards=sequence_shards))
    for name, tensor in (("position_ids", position_ids), ("labels", labels), ("targets", targets)):
        if tensor is not None and tuple(tensor.shape) != (batch, length):
            raise ValueError(f"{name} must be [B, T] = {(batch, length)} like input_ids, got {tuple(tensor.shape)}")
