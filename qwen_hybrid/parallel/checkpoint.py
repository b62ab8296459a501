"""Load an HF Qwen3.5 checkpoint straight into tensor-parallel shards: each rank reads only the
slices it holds (safetensors slice reads), and no rank ever materialises the full model."""
from __future__ import annotations

import os

import torch
from safetensors import safe_open

from qwen_hybrid import checkpoint_io
from qwen_hybrid.config import QwenHybridConfig
from qwen_hybrid.model import QwenHybridForCausalLM
from qwen_hybrid.parallel.groups import ParallelGroups
from qwen_hybrid.parallel.sharding import attach_tensor_parallel, cut_to_local_shards, plan_tensor_parallel


def load_sharded_hf_checkpoint(
    path: str | os.PathLike,
    groups: ParallelGroups,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **config_overrides,
) -> QwenHybridForCausalLM:
    """This rank's shard of the checkpoint at `path`, as `shard_model(from_pretrained(path))` would
    give it. Arguments as `QwenHybridForCausalLM.from_pretrained`; tp = 1 is `from_pretrained`.
    Every rank of the tensor-parallel group must call it (the hooks it attaches are collective)."""
    if groups.tp_size == 1:
        return QwenHybridForCausalLM.from_pretrained(path, dtype=dtype, device=device, **config_overrides)
    config = QwenHybridConfig.from_hf(checkpoint_io.read_config(path), **config_overrides)
    plan = plan_tensor_parallel(config, groups.tp_size, groups.tp_rank)
    with torch.device("meta"):
        model = QwenHybridForCausalLM(config)
    full_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    cut_to_local_shards(model, plan, groups)
    wanted = set(full_shapes)
    if config.tie_word_embeddings:
        wanted.discard("lm_head.weight")

    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in checkpoint_io.checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = checkpoint_io.hf_name_to_ours(hf_name)
                if name is None or (name == "lm_head.weight" and name not in wanted):
                    continue
                if name not in wanted:
                    unexpected.append(hf_name)
                    continue
                stored = f.get_slice(hf_name)
                if tuple(stored.get_shape()) != full_shapes[name]:
                    raise ValueError(
                        f"checkpoint tensor {hf_name} in {file.name} has shape {tuple(stored.get_shape())}, "
                        f"but the config gives {name} the shape {full_shapes[name]}"
                    )
                shard = plan.shards.get(name)
                if shard is None:
                    tensor = stored[:]
                else:
                    leading = (slice(None),) * shard.dim
                    tensor = torch.cat(
                        [stored[leading + (slice(start, end),)] for start, end in shard.pieces], dim=shard.dim
                    )
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor.to(device) if device is not None else tensor
    if unexpected:
        raise ValueError(
            f"checkpoint {path} has {len(unexpected)} tensors the model does not have, e.g. {unexpected[:5]} "
            f"(does config.json match the weights?)"
        )
    missing = sorted(wanted - set(state))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    attach_tensor_parallel(model, plan, groups)
    return model
