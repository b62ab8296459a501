"""HF Qwen3.5 checkpoint directories <-> our state dicts: the one place that knows HF's names.

Our parameter names are those of HF's text-only `Qwen3_5ForCausalLM` (`model.layers.N...`,
`model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`), so saving writes them as
they are. Loading also accepts the full multimodal `Qwen3_5ForConditionalGeneration` layout,
whose text tower sits under `model.language_model.`, and skips its vision tower and the
multi-token-prediction head.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
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
        previous = _previous_dir(Path(path))
        hint = ""
        if not Path(path).exists() and (previous / CONFIG_FILE).is_file():
            # a save was interrupted between its two renames: the last complete checkpoint is aside
            hint = f"; {previous} holds the checkpoint of an interrupted save: rename it to {path}"
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}{hint}")
    with open(config_path) as f:
        return json.load(f)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: from the shard index when there is one."""
    directory = Path(path)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"shard index {index_path} is unreadable ({error!r}); expected JSON with a 'weight_map' of "
                f"tensor name -> shard file"
            ) from error
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                names = [tensor for tensor, shard in weight_map.items() if shard == file.name]
                raise FileNotFoundError(
                    f"shard index {index_path} names shard {file.name} (for {len(names)} tensors, e.g. {names[:3]}), "
                    f"but {file} does not exist"
                )
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files ({SINGLE_FILE} or {INDEX_FILE}) in {path}")
    return files


def _damage_report(file: Path) -> str:
    """What a safetensors file's header promises against what is on disk (best effort)."""
    size = file.stat().st_size
    if size < 8:
        return f"it has {size} bytes, expected at least 8 (the header length)"
    with open(file, "rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        if 8 + header_length > size:
            return f"it has {size} bytes, but its header alone claims {8 + header_length}"
        try:
            header = json.loads(f.read(header_length))
            data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                           default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return f"its {header_length}-byte header is not valid safetensors JSON"
    expected = 8 + header_length + data_end
    if size != expected:
        return f"it has {size} bytes, but its header describes {expected} (truncated or incomplete copy?)"
    return "its size matches its header"


@contextlib.contextmanager
def _open_safetensors(file: Path):
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(
            f"checkpoint file {file} is not a readable safetensors file: {error}; {_damage_report(file)}"
        ) from error
    with handle as f:
        yield f


def load_state_dict(
    path: str | os.PathLike,
    expected_shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    read: Callable[[str, Any], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the checkpoint's tensors under our names, one tensor at a time (no full CPU copy).

    Raises ValueError naming the tensor for a shape mismatch, a tensor the model lacks, a model
    parameter the checkpoint lacks, or a tensor stored twice (two files, or two HF names for one of
    ours); and naming the file for one safetensors cannot read. `lm_head.weight` absent from
    `expected_shapes` (tied embeddings) is skipped when present. Floating tensors are cast to
    `dtype` when given. `read(name, stored)` turns a safetensors slice into the tensor to keep
    (default: all of it); tensor-parallel loading passes one that reads only this rank's part.
    """
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    # where each tensor came from: otherwise a second copy silently replaces the first
    hf_origin: dict[str, Path] = {}
    our_origin: dict[str, tuple[str, Path]] = {}
    for file in checkpoint_files(path):
        with _open_safetensors(file) as f:
            for hf_name in f.keys():
                if hf_name in hf_origin:
                    raise ValueError(
                        f"checkpoint {path} stores tensor {hf_name} twice: in {hf_origin[hf_name]} and in {file}; "
                        f"expected each tensor in exactly one file (a stale shard from another save?)"
                    )
                hf_origin[hf_name] = file
                name = hf_name_to_ours(hf_name)
                if name is None or (name == "lm_head.weight" and name not in expected_shapes):
                    continue
                if name not in expected_shapes:
                    unexpected.append(hf_name)
                    continue
                if name in our_origin:
                    first_name, first_file = our_origin[name]
                    raise ValueError(
                        f"checkpoint {path} stores {name} twice: as {first_name} in {first_file} and as {hf_name} "
                        f"in {file}; expected one of them"
                    )
                our_origin[name] = (hf_name, file)
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
    config.json's dtype is the embedding's.

    Crash-safe: everything is written and fsynced into the sibling `<path>.partial`, then swapped
    in (`path` renamed to `<path>.previous`, `.partial` renamed to `path`, `.previous` deleted), so
    at any moment one complete checkpoint exists. Other files in `path` (a tokenizer saved next to
    the weights, say) are carried over. One writer per `path` at a time.
    """
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf_config = config.to_hf()
    hf_config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            # a view into a larger storage: safetensors refuses shared storage, and the splitter
            # would count the whole storage against the shard size
            tensor = tensor.clone()
        tensors[name] = tensor
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_bytes
    )

    directory = Path(path)
    if directory.is_symlink():
        directory = directory.resolve()  # keep the link, replace what it points at
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save: {path} is a file; expected a checkpoint directory (or a path to create)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(directory.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)  # left by a save that crashed before its swap
    staging.mkdir()
    try:
        for file_name, names in split.filename_to_tensors.items():
            _write_shard(staging / file_name, {name: tensors[name] for name in names})
        if split.is_sharded:
            _write_json(staging / INDEX_FILE, {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
        _write_json(staging / CONFIG_FILE, hf_config)
        if directory.is_dir():
            _carry_over_other_files(directory, staging)
        fsync_dir(staging)
        _swap_in(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _is_checkpoint_file(name: str) -> bool:
    return name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE) or (
        name.startswith("model-") and "-of-" in name and name.endswith(".safetensors")
    )


def _write_shard(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(file), metadata={"format": "pt"})
    fsync_file(file)


def _write_json(file: Path, value: dict) -> None:
    with open(file, "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(file: Path) -> None:
    """Flush `file`'s data to disk (its writer may be another process)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make renames and new entries in `directory` durable (POSIX; a no-op where it is not supported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)  # no copy of large files; the old directory goes away anyway
    except OSError:
        shutil.copy2(source, destination)


def _carry_over_other_files(old: Path, new: Path) -> None:
    for entry in old.iterdir():
        if _is_checkpoint_file(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        else:
            _link_or_copy(str(entry), str(new / entry.name))


def _previous_dir(directory: Path) -> Path:
    return directory.with_name(directory.name + ".previous")


def _swap_in(staging: Path, directory: Path) -> None:
    previous = _previous_dir(directory)
    if previous.exists() and directory.exists():
        shutil.rmtree(previous)  # left by a save that crashed while deleting it
    # (previous without directory: a save crashed between the renames; previous is the last
    # complete checkpoint and stays until the new one is in place)
    moved_aside = directory.exists()
    if moved_aside:
        directory.rename(previous)
    try:
        staging.rename(directory)
    except BaseException:
        if moved_aside and not directory.exists():
            previous.rename(directory)
        raise
    fsync_dir(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)
