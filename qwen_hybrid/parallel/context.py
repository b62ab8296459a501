"""Context parallelism for `QwenHybridForCausalLM`: the cp ranks of a group each hold one contiguous
slice of the packed sequence (B = 1, documents may cross slices; cu_seqlens stays global).

    groups = init_parallel_groups(tp, cp)            # world = dp x cp x tp
    model = shard_model(model, groups)               # tensor parallelism first (tp = 1: unchanged)
    model = apply_context_parallel(model, groups)    # cp = 1: unchanged
    part = context_parallel_slice(input_ids, cu_seqlens, labels, cp_size=groups.cp_size, cp_rank=groups.cp_rank)
    loss = model(**part.model_inputs()).loss         # the whole sequence's mean loss, on every cp rank
    loss.backward()                                  # then average parameter gradients over dp x cp

Per block (docs/context-parallel.md has the design and its costs):
- Gated DeltaNet: after the in-projections a head all-to-all gives each rank the whole sequence
  of 1/cp of its key heads (with their value heads, b, a and conv channels); the causal conv and
  the gated delta rule run there on whole documents, exactly as unsharded; a second all-to-all
  brings the output back to token slices before the per-head gated norm and out_proj.
- Gated attention: Ulysses, the same exchange on query heads (after q/k norm and RoPE, which are
  per token); KV heads fewer than cp are repeated so each rank gets the one its query heads read.
- Everything else (embedding, norms, MLP, LM head) is per token and runs on the slice.

The loss contract: `targets` for the slice are the next-token targets taken from the whole
sequence (the last token of a slice predicts the next slice's first token unless a document ends
there; `context_parallel_slice` builds them). Each rank's loss is (sum over ranks of local
token-loss sums) / (scored tokens in the whole sequence), through a differentiable all-reduce:
the same value on every rank, equal to the unsharded model's loss. Back-propagated on every
rank, it gives each rank cp x the gradient of its own tokens' share, so the MEAN of the
parameter gradients over the cp group is exactly the unsharded gradient. DeepSpeed, given
`mpu=groups`, averages over dp x cp (the ranks holding the same parameters): the mean over dp
of the unsharded gradients, as for data parallelism alone. A per-token term a caller adds to
the loss on its slice must be scaled by cp the same way.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import torch
import torch.distributed as dist

from qwen_hybrid.config import QwenHybridConfig
from qwen_hybrid.loss import IGNORE_INDEX
from qwen_hybrid.layers import positions_in_documents
from qwen_hybrid.model import QwenHybridForCausalLM, shift_labels
from qwen_hybrid.parallel.collectives import (
    all_reduce_staged,
    all_reduce_sum,
    heads_to_tokens,
    tokens_to_heads,
)
from qwen_hybrid.parallel.groups import ParallelGroups


@dataclasses.dataclass(frozen=True)
class ContextParallelPlan:
    """What context parallelism does to a model, per module: `mixers`, the token mixers that get a
    head exchange, by path -> the heads each cp rank mixes; `loss_module`, whose loss is summed over
    the group. No parameter is split over cp: every one is replicated on the group."""

    cp_size: int
    cp_rank: int
    tp_size: int
    mixers: Mapping[str, Mapping[str, int]]
    loss_module: str = "lm_head"


def plan_context_parallel(config: QwenHybridConfig, cp_size: int, cp_rank: int = 0, tp_size: int = 1) -> ContextParallelPlan:
    """The plan of one cp rank, for a model whose heads tensor parallelism already split over
    `tp_size`. Raises ValueError naming the layer and the counts when a block's heads on one
    tensor-parallel rank do not split over cp_size."""
    for name, value in (("cp_size", cp_size), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    cp, tp = cp_size, tp_size
    mixers: dict[str, dict[str, int]] = {}
    for i, layer_type in enumerate(config.layer_types):
        if layer_type == "linear_attention":
            block = f"model.layers.{i}.linear_attn"
            num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
            if num_k % tp != 0:
                raise ValueError(f"{block}: linear_num_key_heads = {num_k} does not divide by tp = {tp}")
            k_local = num_k // tp
            if k_local % cp != 0:
                raise ValueError(
                    f"{block}: {k_local} key heads a tensor-parallel rank (linear_num_key_heads = {num_k}, "
                    f"tp = {tp}) do not divide by cp = {cp}; the head all-to-all gives each cp rank whole key "
                    f"heads with their {num_v // num_k} value heads, so cp must divide {k_local}"
                )
            mixers[block] = {"num_k_heads": k_local // cp, "num_v_heads": num_v // tp // cp}
        else:
            block = f"model.layers.{i}.self_attn"
            num_heads, num_kv = config.num_attention_heads, config.num_key_value_heads
            if num_heads % tp != 0:
                raise ValueError(f"{block}: num_attention_heads = {num_heads} does not divide by tp = {tp}")
            heads_local = num_heads // tp
            kv_local = num_kv // tp if num_kv % tp == 0 else 1  # tensor parallelism replicates below tp
            if heads_local % cp != 0:
                raise ValueError(
                    f"{block}: {heads_local} query heads a tensor-parallel rank (num_attention_heads = "
                    f"{num_heads}, tp = {tp}) do not divide by cp = {cp}"
                )
            if kv_local % cp != 0 and cp % kv_local != 0:
                raise ValueError(
                    f"{block}: {kv_local} KV heads a tensor-parallel rank (num_key_value_heads = {num_kv}, "
                    f"tp = {tp}) and cp = {cp}: KV heads are split when cp divides them and repeated when they "
                    f"divide cp, neither holds"
                )
            mixers[block] = {"num_heads": heads_local // cp, "num_kv_heads": max(kv_local // cp, 1)}
    return ContextParallelPlan(cp_size=cp, cp_rank=cp_rank, tp_size=tp, mixers=mixers)


class HeadExchange:
    """A token mixer's `head_exchange` (see qwen_hybrid/layers.py): moves tensors between this
    rank's token slice of every head and its head group over the whole sequence, over `group`."""

    def __init__(self, group, size: int, rank: int):
        self.group = group
        self.size = size
        self.rank = rank

    def to_heads(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return tokens_to_heads(parts, self.group)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return heads_to_tokens(x, self.group)

    def __repr__(self) -> str:
        return f"HeadExchange(rank {self.rank} of {self.size})"


def apply_context_parallel(model: QwenHybridForCausalLM, groups: ParallelGroups) -> QwenHybridForCausalLM:
    """Split the sequence of `model` over `groups.cp_group`, in place; returns it. Call after
    `shard_model` (or `load_sharded_hf_checkpoint`) on every rank; cp = 1 returns the model
    untouched. The parameters are not touched: they stay replicated over the cp group, whose
    ranks must start from equal weights (DeepSpeed's initial broadcast over its data-parallel
    group, dp x cp, ensures it).

    Afterwards the model takes one slice per forward: see `context_parallel_slice`."""
    if not isinstance(model, QwenHybridForCausalLM):
        raise TypeError(f"model must be a QwenHybridForCausalLM, got {type(model).__name__}")
    if groups.cp_size == 1:
        return model
    if model.model.sequence_shards != 1:
        raise ValueError(f"model already has context parallelism applied (sequence_shards = {model.model.sequence_shards})")
    tp_plan = model.tensor_parallel_plan
    sharded_tp = 1 if tp_plan is None else tp_plan.tp_size
    if sharded_tp != groups.tp_size:
        raise ValueError(
            f"groups.tp_size = {groups.tp_size} but the model is sharded over tp = {sharded_tp}; call "
            f"shard_model(model, groups) before apply_context_parallel"
        )
    if dist.get_rank(groups.cp_group) != groups.cp_rank:
        raise RuntimeError(
            f"groups.cp_rank = {groups.cp_rank} but this rank is {dist.get_rank(groups.cp_group)} in groups.cp_group"
        )
    plan = plan_context_parallel(model.config, groups.cp_size, groups.cp_rank, groups.tp_size)
    exchange = HeadExchange(groups.cp_group, groups.cp_size, groups.cp_rank)
    for path in plan.mixers:
        model.get_submodule(path).head_exchange = exchange
    model.model.sequence_shards = groups.cp_size
    model.get_submodule(plan.loss_module).register_forward_hook(
        functools.partial(_loss_over_slices, group=groups.cp_group), with_kwargs=True
    )
    return model


def _loss_over_slices(module, args, kwargs, output, group):
    """The LM head's mean over this slice's scored tokens -> the mean over the whole sequence's."""
    labels = args[1] if len(args) > 1 else kwargs.get("labels")
    if labels is None:
        return output  # logits of this slice
    scored = (labels != IGNORE_INDEX).sum()
    scored_everywhere = all_reduce_staged(scored, group)
    return all_reduce_sum(output * scored, group) / scored_everywhere.clamp(min=1)


@dataclasses.dataclass(frozen=True)
class SequenceSlice:
    """One cp rank's part of a packed batch. input_ids, position_ids, targets: [B, T/cp], this
    rank's tokens, their positions in their documents, and their next-token targets (-100: none)
    from the whole sequence; cu_seqlens: the whole sequence's offsets, unchanged; num_targets:
    the scored tokens of the whole sequence (the loss's denominator)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor | None
    num_targets: int

    def model_inputs(self) -> dict:
        """The model's keyword arguments for this slice."""
        return dict(input_ids=self.input_ids, cu_seqlens=self.cu_seqlens, position_ids=self.position_ids,
                    targets=self.targets)


def context_parallel_slice(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    cp_size: int,
    cp_rank: int,
) -> SequenceSlice:
    """Slice `cp_rank` of `cp_size` of a packed batch: input_ids [B, T] (B = 1 with cu_seqlens),
    cu_seqlens [N+1] over the whole row, labels [B, T] aligned with input_ids like HF's (default:
    input_ids; -100 ignored). Targets are shifted over the whole sequence, as the unsharded
    model shifts labels: none at the last token of each document or of the row. T must divide
    by cp_size (by tp * cp_size with sequence parallelism)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [B, T] tensor, got {shape}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    batch, length = input_ids.shape
    if length % cp_size != 0:
        raise ValueError(
            f"input_ids has T = {length} tokens, which cp_size = {cp_size} does not divide; pack (or pad) to a "
            f"multiple of cp (of tp x cp with sequence parallelism)"
        )
    if labels is None:
        labels = input_ids
    if tuple(labels.shape) != (batch, length):
        raise ValueError(f"labels must be [B, T] = {(batch, length)} like input_ids, got {tuple(labels.shape)}")
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs input_ids with B = 1 (documents packed in one row), got B = {batch}")
        bounds = cu_seqlens.tolist()
        if cu_seqlens.dim() != 1 or bounds[0] != 0 or bounds[-1] != length or any(
            b < a for a, b in zip(bounds[:-1], bounds[1:])
        ):
            raise ValueError(f"cu_seqlens must start at 0, end at T = {length} and not decrease, got {bounds[:8]}")
    positions = positions_in_documents(length, cu_seqlens, input_ids.device)
    targets = shift_labels(labels, None if cu_seqlens is None else cu_seqlens.to(labels.device))
    chunk = length // cp_size
    window = slice(cp_rank * chunk, (cp_rank + 1) * chunk)
    return SequenceSlice(
        input_ids=input_ids[:, window],
        position_ids=positions[window].unsqueeze(0).expand(batch, chunk).contiguous(),
        targets=targets[:, window],
        cu_seqlens=cu_seqlens,
        num_targets=int((targets != IGNORE_INDEX).sum()),
    )
