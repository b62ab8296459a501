"""HF Qwen3.5 checkpoint directories <-> our state dicts: the one place that knows HF's names.

Our parameter names are those of HF's text-only `Qwen3_5ForCausalLM` (`model.layers.N...`,
`model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`), so saving writes them as
they are. Loading also accepts the full multimodal `Qwen3_5ForConditionalGeneration` layout,
whose text tower sits under `model.language_model.`, and skips its vision tower and the
multi-token-prediction head.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_hybrid.config import QwenHybridConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# (HF prefix, our prefix), the first match wins
_PREFIX_MAP = (("model.language_model.", "model."), ("model.", "model."), ("lm_head.", "lm_head."))
# parts of the full checkpoint that are not the text decoder
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")


def hf_name_to_ours(name: str) -> str | None:
    """Our parameter name for an HF checkpoint tensor name; None for tensors we do not model."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for hf_prefix, our_prefix in _PREFIX_MAP:
        if name.startswith(hf_prefix):
            return our_prefix + name[len(hf_prefix):]
    return name


def read_config(path: str | os.PathLike) -> dict:
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    with open(config_path) as f:
        return json.load(f)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: from the shard index when there is one."""
    directory = Path(path)
    if (directory / INDEX_FILE).is_file():
        with open(directory / INDEX_FILE) as f:
            weight_map = json.load(f)["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files ({SINGLE_FILE} or {INDEX_FILE}) in {path}")
    return files


def load_state_dict(
    path: str | os.PathLike,
    expected_shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    read: Callable[[str, Any], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the checkpoint's tensors under our names, one tensor at a time (no full CPU copy).

    Raises ValueError naming the tensor for a shape mismatch, a tensor the model lacks, or a
    model parameter the checkpoint lacks. `lm_head.weight` absent from `expected_shapes` (tied
    embeddings) is skipped when present. Floating tensors are cast to `dtype` when given.
    `read(name, stored)` turns a safetensors slice into the tensor to keep (default: all of it);
    tensor-parallel loading passes one that reads only this rank's part.
    """
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = hf_name_to_ours(hf_name)
                if name is None or (name == "lm_head.weight" and name not in expected_shapes):
                    continue
                if name not in expected_shapes:
                    unexpected.append(hf_name)
                    continue
                stored = f.get_slice(hf_name)
                if tuple(stored.get_shape()) != expected_shapes[name]:
                    raise ValueError(
                        f"checkpoint tensor {hf_name} in {file.name} has shape {tuple(stored.get_shape())}, "
                        f"but the config gives {name} the shape {expected_shapes[name]}"
                    )
                tensor = stored[:] if read is None else read(name, stored)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor.to(device) if device is not None else tensor
    if unexpected:
        raise ValueError(
            f"checkpoint {path} has {len(unexpected)} tensors the model does not have, e.g. {unexpected[:5]} "
            f"(does config.json match the weights?)"
        )
    missing = [name for name in expected_shapes if name not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}")
    return state


def load_into(
    model: torch.nn.Module,
    path: str | os.PathLike,
    expected_shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    read: Callable[[str, Any], torch.Tensor] | None = None,
) -> None:
    """Assign the checkpoint's tensors to `model` (built on the meta device), reading as
    `load_state_dict` does. A tied lm_head is not read: it is tied to the embedding again."""
    tied = model.config.tie_word_embeddings
    if tied:
        expected_shapes = {name: shape for name, shape in expected_shapes.items() if name != "lm_head.weight"}
    state = load_state_dict(path, expected_shapes, dtype, device, read=read)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def save(
    path: str | os.PathLike,
    config: QwenHybridConfig,
    state: dict[str, torch.Tensor],
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    """Write the full (unsharded) `state` and `config` as HF's config.json and safetensors (sharded
    with an index past max_shard_bytes). A tied `lm_head.weight` is left out, as HF saves it;
    config.json's dtype is the embedding's."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf_config = config.to_hf()
    hf_config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    total_bytes = 0
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
        total_bytes += size
    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file_name), metadata={"format": "pt"})
            weight_map.update({name: file_name for name in shard})
        with open(directory / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    with open(directory / CONFIG_FILE, "w") as f:
        json.dump(hf_config, f, indent=2)
