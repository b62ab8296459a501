"""Tensor parallelism for `QwenHybridForCausalLM`, applied from outside to a built model.

Per decoder layer, rank r of a tensor-parallel group of size tp holds:
- Gated DeltaNet: key heads [r*Hk/tp, (r+1)*Hk/tp) with exactly the value heads that read them
  (value head h reads key head h // (Hv/Hk), so contiguous splits of both stay group-aligned):
  those rows of the fused q|k|v projection and conv1d channels, of z, b, a, A_log and dt_bias;
  the matching input columns of out_proj (row-parallel).
- Gated attention: query heads (with their output gates) split; KV heads split when tp divides
  them, otherwise replicated (each rank keeps the one KV head its query heads read); o_proj
  row-parallel.
- MLP: gate/up rows (column-parallel), down_proj columns (row-parallel).
- Embedding and LM head: vocabulary rows (`vocab.py`).
Norm weights shared by all heads (the GDN output norm, q_norm, k_norm) stay whole on every rank;
their gradients, computed from local heads only, are summed over the group. Residual-stream norms
need nothing (without sequence parallelism): their inputs and gradients are whole on every rank.

Each block's input passes `copy_to_tensor_parallel` and its output `reduce_from_tensor_parallel`
(module hooks), so the model code runs unchanged on its local head counts (the blocks read them
from their projections' outputs).

The plan is declared per module, as torchtitan's parallelize plans are: `TensorParallelPlan.modules`
maps a module path to a `ModulePlan` saying which of its parameters is cut along which dim over
which group, which whole parameters get partial gradients summed over which group, and whether
the module is a head-sharded block wrapped in the tp collectives. `shard_model` applies it;
`plan.shards` / `plan.partial_gradient` / `plan.local_heads` are flat views of it by full name.

Sequence parallelism (`sequence_parallel=True`, Megatron's): between blocks each rank keeps only
T/tp tokens of the residual stream; blocks all-gather their input tokens and reduce-scatter their
output, the embedding reduce-scatters, the final norm all-gathers for the LM head. Same traffic,
and the layer inputs that activation checkpointing keeps (and the residual norms' activations)
shrink by tp. The token count must divide by tp; the residual norms' gradients are then summed
over the group too.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from qwen_hybrid.config import QwenHybridConfig
from qwen_hybrid.layers import DecoderLayer
from qwen_hybrid.model import QwenHybridForCausalLM
from qwen_hybrid.parallel.collectives import (
    copy_to_tensor_parallel,
    gather_tokens,
    reduce_from_tensor_parallel,
    reduce_scatter_tokens,
)
from qwen_hybrid.parallel.groups import ParallelGroups
from qwen_hybrid.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead


@dataclasses.dataclass(frozen=True)
class ParameterShard:
    """The part of a full parameter one rank holds: the pieces [start, end) along `dim`, concatenated
    in order. `copies` ranks hold this same slice (replicated KV heads); `first_copy` is False on
    all but the lowest of them, so a gradient norm counts the slice once."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    full_size: int
    copies: int = 1
    first_copy: bool = True
    group: str = "tp"  # the ParallelGroups axis the parameter is split over

    @property
    def local_size(self) -> int:
        return sum(end - start for start, end in self.pieces)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a new tensor)."""
        return torch.cat([full.narrow(self.dim, start, end - start) for start, end in self.pieces], dim=self.dim)

    def place(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write this rank's slice `local` into its place in `full`."""
        offset = 0
        for start, end in self.pieces:
            full.narrow(self.dim, start, end - start).copy_(local.narrow(self.dim, offset, end - start))
            offset += end - start


# ModulePlan.wrap values
HEAD_BLOCK = "head_block"  # input: copy (or gather tokens); output: reduce (or reduce-scatter tokens)
GATHER_OUTPUT_TOKENS = "gather_output_tokens"  # output all-gathered by tokens (sequence parallelism)


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """One module's part of the tensor-parallel layout on this rank. Parameter names are relative
    to the module (`in_proj_qkv.weight`).

    shards: parameters cut along `shard.dim` over `shard.group`; every other parameter is whole.
    partial_gradients: whole parameters whose gradient here covers only this rank's heads (or
        tokens), name -> the group whose sum completes it.
    local_heads: the head counts the module holds once cut (as the module reads them, for checks).
    wrap: collectives around the module's forward: HEAD_BLOCK, GATHER_OUTPUT_TOKENS or None.
    """

    shards: Mapping[str, ParameterShard] = dataclasses.field(default_factory=dict)
    partial_gradients: Mapping[str, str] = dataclasses.field(default_factory=dict)
    local_heads: Mapping[str, int] = dataclasses.field(default_factory=dict)
    wrap: str | None = None


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """What rank `tp_rank` of `tp_size` holds: `modules`, the plan of each module by path (modules
    not listed stay whole and unwrapped); `vocab_start`: first vocabulary row of the embedding and
    LM head; `sequence_parallel`: the residual stream is split by tokens between blocks."""

    tp_size: int
    tp_rank: int
    modules: Mapping[str, ModulePlan]
    vocab_start: int
    sequence_parallel: bool = False

    @functools.cached_property
    def shards(self) -> dict[str, ParameterShard]:
        """Every cut parameter by full name."""
        return {_join(path, name): shard for path, module in self.modules.items() for name, shard in module.shards.items()}

    @functools.cached_property
    def partial_gradient(self) -> tuple[str, ...]:
        """Full names of the whole parameters whose gradients are summed over the group."""
        return tuple(_join(path, name) for path, module in self.modules.items() for name in module.partial_gradients)

    @functools.cached_property
    def local_heads(self) -> dict[str, dict[str, int]]:
        """Head counts per block path (blocks that hold heads)."""
        return {path: dict(module.local_heads) for path, module in self.modules.items() if module.local_heads}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def plan_tensor_parallel(
    config: QwenHybridConfig, tp_size: int, tp_rank: int, sequence_parallel: bool = False
) -> TensorParallelPlan:
    """The shard plan of one rank. Raises ValueError naming the layer and the counts when a head
    count, the intermediate size or the vocabulary does not split over tp_size."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    tp, r = tp_size, tp_rank
    modules: dict[str, ModulePlan] = {}

    def rows(start: int, count: int) -> tuple[int, int]:
        return (start + r * count, start + (r + 1) * count)

    for i, layer_type in enumerate(config.layer_types):
        prefix = f"model.layers.{i}"
        if layer_type == "linear_attention":
            block = f"{prefix}.linear_attn"
            num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
            dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
            if num_k % tp != 0:
                raise ValueError(
                    f"{block}: linear_num_key_heads = {num_k} does not divide by tp = {tp} (each rank needs whole "
                    f"key heads, with the {num_v // num_k} value heads that read each; "
                    f"linear_num_value_heads = {num_v})"
                )
            k_local, v_local = num_k // tp, num_v // tp
            key_dim, value_dim = num_k * dk, num_v * dv
            qkv = (rows(0, k_local * dk), rows(key_dim, k_local * dk), rows(2 * key_dim, v_local * dv))
            qkv_size = 2 * key_dim + value_dim
            value_heads = ParameterShard(0, (rows(0, v_local),), num_v)
            modules[block] = ModulePlan(
                shards={
                    "in_proj_qkv.weight": ParameterShard(0, qkv, qkv_size),
                    "conv1d.weight": ParameterShard(0, qkv, qkv_size),
                    "in_proj_z.weight": ParameterShard(0, (rows(0, v_local * dv),), value_dim),
                    "in_proj_b.weight": value_heads, "in_proj_a.weight": value_heads,
                    "dt_bias": value_heads, "A_log": value_heads,
                    "out_proj.weight": ParameterShard(1, (rows(0, v_local * dv),), value_dim),
                },
                partial_gradients={"norm.weight": "tp"},
                local_heads={"num_k_heads": k_local, "num_v_heads": v_local},
                wrap=HEAD_BLOCK,
            )
        else:
            block = f"{prefix}.self_attn"
            num_heads, num_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
            if num_heads % tp != 0:
                raise ValueError(f"{block}: num_attention_heads = {num_heads} does not divide by tp = {tp}")
            if num_kv % tp != 0 and tp % num_kv != 0:
                raise ValueError(
                    f"{block}: num_key_value_heads = {num_kv} and tp = {tp}: KV heads are split when tp divides "
                    f"them and replicated when they divide tp, neither holds"
                )
            heads_local = num_heads // tp
            if num_kv % tp == 0:
                kv_local = num_kv // tp
                kv_shard = ParameterShard(0, (rows(0, kv_local * head_dim),), num_kv * head_dim)
            else:
                kv_local, copies = 1, tp // num_kv
                kv_head = r // copies
                kv_shard = ParameterShard(
                    0, ((kv_head * head_dim, (kv_head + 1) * head_dim),), num_kv * head_dim,
                    copies=copies, first_copy=r % copies == 0,
                )
            modules[block] = ModulePlan(
                shards={
                    # query rows hold [query | gate] per head
                    "q_proj.weight": ParameterShard(0, (rows(0, heads_local * 2 * head_dim),), num_heads * 2 * head_dim),
                    "k_proj.weight": kv_shard,
                    "v_proj.weight": kv_shard,
                    "o_proj.weight": ParameterShard(1, (rows(0, heads_local * head_dim),), num_heads * head_dim),
                },
                partial_gradients={"q_norm.weight": "tp", "k_norm.weight": "tp"},
                local_heads={"num_heads": heads_local, "num_kv_heads": kv_local},
                wrap=HEAD_BLOCK,
            )
        intermediate = config.intermediate_size
        if intermediate % tp != 0:
            raise ValueError(f"{prefix}.mlp: intermediate_size = {intermediate} does not divide by tp = {tp}")
        mlp_rows = (rows(0, intermediate // tp),)
        modules[f"{prefix}.mlp"] = ModulePlan(
            shards={
                "gate_proj.weight": ParameterShard(0, mlp_rows, intermediate),
                "up_proj.weight": ParameterShard(0, mlp_rows, intermediate),
                "down_proj.weight": ParameterShard(1, mlp_rows, intermediate),
            },
            wrap=HEAD_BLOCK,
        )
        if sequence_parallel:  # residual norms then see only this rank's tokens
            for norm in ("input_layernorm", "post_attention_layernorm"):
                modules[f"{prefix}.{norm}"] = ModulePlan(partial_gradients={"weight": "tp"})
    if config.vocab_size % tp != 0:
        raise ValueError(
            f"model.embed_tokens / lm_head: vocab_size = {config.vocab_size} does not divide by tp = {tp}"
        )
    vocab_rows = (rows(0, config.vocab_size // tp),)
    modules["model.embed_tokens"] = ModulePlan(shards={"weight": ParameterShard(0, vocab_rows, config.vocab_size)})
    modules["lm_head"] = ModulePlan(shards={"weight": ParameterShard(0, vocab_rows, config.vocab_size)})
    if sequence_parallel:
        modules["model.norm"] = ModulePlan(partial_gradients={"weight": "tp"}, wrap=GATHER_OUTPUT_TOKENS)
    return TensorParallelPlan(
        tp_size=tp, tp_rank=r, modules=modules, vocab_start=vocab_rows[0][0], sequence_parallel=sequence_parallel,
    )


def shard_model(
    model: QwenHybridForCausalLM, groups: ParallelGroups, sequence_parallel: bool = False
) -> QwenHybridForCausalLM:
    """Shard a built model by heads over `groups.tp_group`, in place; returns it. With
    `sequence_parallel` the residual stream is also split by tokens (see the module docstring).

    Every rank of the tensor-parallel group calls this on its copy of the model; the weights are
    first broadcast from the group's first rank, so the copies need not agree. tp = 1 returns the
    model untouched. Apply before DeepSpeed wrapping (and before building an optimizer); do not
    replace the parameters afterwards (their gradient hooks live on them).
    """
    if not isinstance(model, QwenHybridForCausalLM):
        raise TypeError(f"model must be a QwenHybridForCausalLM, got {type(model).__name__}")
    if groups.tp_size == 1:
        return model
    if model.tensor_parallel_plan is not None:
        raise ValueError("model is already sharded (it has a tensor_parallel_plan)")
    if model.model.sequence_shards > 1:
        raise ValueError(
            f"model already has context parallelism applied (sequence_shards = {model.model.sequence_shards}); "
            "call shard_model first, then apply_context_parallel"
        )
    plan = plan_tensor_parallel(model.config, groups.tp_size, groups.tp_rank, sequence_parallel)
    _broadcast_from_first_tp_rank(model, groups)
    cut_to_local_shards(model, plan, groups)
    attach_tensor_parallel(model, plan, groups)
    return model


def _broadcast_from_first_tp_rank(model: nn.Module, groups: ParallelGroups) -> None:
    src = groups.get_tensor_model_parallel_src_rank()
    on_nccl = dist.get_backend(groups.tp_group) == "nccl"
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_meta:
                continue
            if on_nccl and not tensor.is_cuda:
                raise ValueError(
                    f"the tensor-parallel group runs on NCCL but {name} is on {tensor.device}: build or move the "
                    f"model to this rank's GPU before shard_model"
                )
            dist.broadcast(tensor.data, src=src, group=groups.tp_group)


def cut_to_local_shards(model: QwenHybridForCausalLM, plan: TensorParallelPlan, groups: ParallelGroups) -> None:
    """Replace every planned parameter by this rank's slice (meta parameters stay meta) and swap
    the embedding and LM head for their vocabulary-parallel forms. The blocks read their (now
    local) head counts from their projections, so nothing else changes on them."""
    config = model.config
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for layer_index, layer in enumerate(model.model.layers):
        _check_plan_covers(layer, f"model.layers.{layer_index}", plan)
    for module_path, module_plan in plan.modules.items():
        module = model.get_submodule(module_path)
        for relative_name, shard in module_plan.shards.items():
            name = _join(module_path, relative_name)
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the same tensor as the embedding: cut once, re-tied below
            old = parameters.pop(name)  # the last reference: each full tensor is freed once cut
            expected = shard.full_size
            if old.shape[shard.dim] != expected:
                raise ValueError(
                    f"{name} has size {old.shape[shard.dim]} along dim {shard.dim}, the plan expects {expected}"
                )
            owner_path, attribute = relative_name.rpartition(".")[::2]
            with torch.no_grad():
                local = nn.Parameter(shard.take(old.detach()), requires_grad=old.requires_grad)
            setattr(module.get_submodule(owner_path) if owner_path else module, attribute, local)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    embedding = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(
        embedding.weight, plan.vocab_start, config.vocab_size, embedding.padding_idx, groups.tp_group,
        sequence_parallel=plan.sequence_parallel,
    )
    head_weight = model.model.embed_tokens.weight if config.tie_word_embeddings else model.lm_head.weight
    model.lm_head = VocabParallelLMHead(
        head_weight, plan.vocab_start, config.vocab_size, groups.tp_group, hidden_gathered=plan.sequence_parallel
    )


def _check_plan_covers(layer: DecoderLayer, prefix: str, plan: TensorParallelPlan) -> None:
    """A parameter of a head-sharded block that the plan does not know would silently stay whole."""
    handled = set(plan.shards) | set(plan.partial_gradient)
    for child in ("linear_attn", "self_attn", "mlp"):
        block = getattr(layer, child, None)
        if block is None:
            continue
        for name, _ in block.named_parameters():
            full_name = f"{prefix}.{child}.{name}"
            if full_name not in handled:
                raise RuntimeError(
                    f"{full_name} is not in the tensor-parallel plan: the model gained a parameter that "
                    f"qwen_hybrid/parallel/sharding.py must learn to split"
                )


def attach_tensor_parallel(model: QwenHybridForCausalLM, plan: TensorParallelPlan, groups: ParallelGroups) -> None:
    """Hooks and attributes on an already cut model: block input/output collectives, gradient sums
    for whole-but-partial parameters and for replicated slices, DeepSpeed's `tensor_model_parallel`
    flags. Call once, after the final parameter tensors are in place."""
    group_of = {"tp": groups.tp_group}
    enter, leave = copy_to_tensor_parallel, reduce_from_tensor_parallel
    if plan.sequence_parallel:
        enter, leave = gather_tokens, reduce_scatter_tokens
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for module_path, module_plan in plan.modules.items():
        module = model.get_submodule(module_path)
        if module_plan.wrap == HEAD_BLOCK:
            module.register_forward_pre_hook(
                functools.partial(_enter_block, collective=enter, group=groups.tp_group), with_kwargs=True
            )
            module.register_forward_hook(functools.partial(_leave_block, collective=leave, group=groups.tp_group))
        elif module_plan.wrap == GATHER_OUTPUT_TOKENS:
            module.register_forward_hook(
                functools.partial(_leave_block, collective=gather_tokens, group=groups.tp_group)
            )
        elif module_plan.wrap is not None:
            raise ValueError(f"{module_path}: unknown wrap {module_plan.wrap!r} in the plan")
        for relative_name, axis in module_plan.partial_gradients.items():
            parameter = parameters[_join(module_path, relative_name)]
            parameter.register_hook(functools.partial(_sum_gradient, group=group_of[axis]))
        for relative_name, shard in module_plan.shards.items():
            parameter = parameters[_join(module_path, relative_name)]
            parameter.tensor_model_parallel = shard.first_copy
            if shard.copies > 1:
                parameter.register_hook(
                    functools.partial(_sum_gradient_over_copies, shard=shard, group=group_of[shard.group])
                )
    model.tensor_parallel_plan = plan


def _enter_block(module, args, kwargs, collective, group):
    if args:
        return (collective(args[0], group), *args[1:]), kwargs
    name = next(iter(kwargs))
    return args, {**kwargs, name: collective(kwargs[name], group)}


def _leave_block(module, args, output, collective, group):
    return collective(output, group)


def _sum_gradient(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(grad, group=group)
    return grad


def _sum_gradient_over_copies(grad: torch.Tensor, shard: ParameterShard, group) -> torch.Tensor:
    # each holder of the slice saw only its own query heads; a zero-padded full-size all-reduce
    # sums the holders of each slice without a process group per KV head
    full_shape = list(grad.shape)
    full_shape[shard.dim] = shard.full_size
    full = grad.new_zeros(full_shape)
    shard.place(grad, full)
    dist.all_reduce(full, group=group)
    return shard.take(full)


def gather_full_state_dict(
    model: QwenHybridForCausalLM, groups: ParallelGroups, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The unsharded state dict (our = HF names), assembled on the first rank of the tensor-parallel
    group (on `device`); the other ranks take part and get {}. Collective over the group.
    Feed it to `checkpoint_io.save` with `model.config` to write an HF checkpoint."""
    plan = model.tensor_parallel_plan
    if plan is None:
        return {name: tensor.detach().to(device) for name, tensor in model.state_dict().items()}
    rank_plans = [
        plan_tensor_parallel(model.config, plan.tp_size, r, plan.sequence_parallel) for r in range(plan.tp_size)
    ]
    keep = groups.tp_rank == 0
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if name not in plan.shards:
            if keep:
                state[name] = tensor.to(device)
            continue
        pieces = [torch.empty_like(tensor) for _ in range(plan.tp_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=groups.tp_group)
        if keep:
            full_shape = list(tensor.shape)
            full_shape[plan.shards[name].dim] = plan.shards[name].full_size
            full = torch.empty(full_shape, dtype=tensor.dtype, device=device)
            for rank_plan, piece in zip(rank_plans, pieces):
                rank_plan.shards[name].place(piece.to(device), full)
            state[name] = full
    return state
