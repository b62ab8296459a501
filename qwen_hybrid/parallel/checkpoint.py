"""HF Qwen3.5 checkpoints and tensor-parallel shards: loading reads only each rank's slices
(safetensors slice reads, no rank materialises the full model); saving gathers the shards of one
data-parallel replica and writes what `save_pretrained` of the unsharded model would."""
from __future__ import annotations

import os

import torch

from qwen_hybrid import checkpoint_io
from qwen_hybrid.config import QwenHybridConfig
from qwen_hybrid.model import QwenHybridForCausalLM
from qwen_hybrid.parallel.groups import ParallelGroups
from qwen_hybrid.parallel.sharding import (
    attach_tensor_parallel,
    cut_to_local_shards,
    gather_full_state_dict,
    plan_tensor_parallel,
)


def load_sharded_hf_checkpoint(
    path: str | os.PathLike,
    groups: ParallelGroups,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    sequence_parallel: bool = False,
    **config_overrides,
) -> QwenHybridForCausalLM:
    """This rank's shard of the checkpoint at `path`, as `shard_model(from_pretrained(path),
    groups, sequence_parallel)` would give it. Other arguments as
    `QwenHybridForCausalLM.from_pretrained`; tp = 1 is `from_pretrained`.
    Every rank of the tensor-parallel group must call it (the hooks it attaches are collective)."""
    if groups.tp_size == 1:
        return QwenHybridForCausalLM.from_pretrained(path, dtype=dtype, device=device, **config_overrides)
    config = QwenHybridConfig.from_hf(checkpoint_io.read_config(path), **config_overrides)
    plan = plan_tensor_parallel(config, groups.tp_size, groups.tp_rank, sequence_parallel)
    with torch.device("meta"):
        model = QwenHybridForCausalLM(config)
    full_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    cut_to_local_shards(model, plan, groups)

    def read_local_part(name: str, stored) -> torch.Tensor:
        shard = plan.shards.get(name)
        if shard is None:
            return stored[:]
        leading = (slice(None),) * shard.dim
        return torch.cat([stored[leading + (slice(start, end),)] for start, end in shard.pieces], dim=shard.dim)

    checkpoint_io.load_into(model, path, full_shapes, dtype, device, read=read_local_part)
    attach_tensor_parallel(model, plan, groups)
    return model


def save_hf_checkpoint(
    model: QwenHybridForCausalLM, groups: ParallelGroups, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3
) -> None:
    """Write the unsharded weights of a (possibly sharded) model as an HF checkpoint at `path`.

    Collective over the tensor-parallel group of data-parallel replica 0 and context-parallel rank 0
    (the other ranks hold copies and return at once); its first rank gathers the full tensors on
    CPU and writes. Under ZeRO-3 call it inside
    `deepspeed.zero.GatheredParameters(model.parameters())`.

    Both paths write through `checkpoint_io.save`: into `<path>.partial`, fsynced, then swapped
    in, so a crash mid-export leaves the previous checkpoint at `path` (or, between the two
    renames, at `<path>.previous`) complete. Only the writing rank touches the filesystem.
    """
    if groups.dp_rank != 0 or groups.cp_rank != 0:
        return
    if model.tensor_parallel_plan is None:
        model.save_pretrained(path, max_shard_bytes=max_shard_bytes)
        return
    state = gather_full_state_dict(model, groups)
    if groups.tp_rank != 0:
        return
    checkpoint_io.save(path, model.config, state, max_shard_bytes=max_shard_bytes)
