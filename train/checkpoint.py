"""DeepSpeed checkpoints of a run (model, optimizer, schedule, trainer state, per-rank RNG) and
the HF export of the final weights.

Layout: run_dir/checkpoints/step_00000100/ (DeepSpeed's files plus rng_rank{r}.pt) and
run_dir/checkpoints/latest (the newest complete tag; DeepSpeed writes it last, so a run that
dies while saving still resumes from the previous checkpoint).
"""
from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from qwen_hybrid.parallel import ParallelGroups, save_hf_checkpoint
from train.config import ConfigError

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
HF_EXPORT_DIR = "hf_final"
TAG_PREFIX = "step_"


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps completed
    data_position: int = 0  # global micro-batches consumed (all data-parallel ranks together)
    tokens_seen: int = 0


@dataclass
class ResumePoint:
    run_dir: Path
    checkpoints_dir: Path
    tag: str


def checkpoint_tag(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def find_resume_point(resume: str, run_dir: str | None) -> ResumePoint | None:
    """Where `train.resume` points: 'auto' (run_dir's latest checkpoint, or None for a fresh
    start), a run directory, its checkpoints directory, or one checkpoint (tag) directory."""
    if resume == "auto":
        checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
        if not (checkpoints_dir / LATEST_FILE).is_file():
            return None
        return ResumePoint(Path(run_dir), checkpoints_dir, (checkpoints_dir / LATEST_FILE).read_text().strip())
    path = Path(resume)
    if (path / CHECKPOINTS_DIR / LATEST_FILE).is_file():
        path = path / CHECKPOINTS_DIR
    if (path / LATEST_FILE).is_file():
        return ResumePoint(path.parent, path, (path / LATEST_FILE).read_text().strip())
    if path.name.startswith(TAG_PREFIX) and any(path.glob("*model_states.pt")):
        return ResumePoint(path.parent.parent, path.parent, path.name)
    raise ValueError(
        f"train.resume={resume!r}: no checkpoint there (expected a run directory with {CHECKPOINTS_DIR}/{LATEST_FILE}, "
        f"or a {TAG_PREFIX}* checkpoint directory)"
    )


def save_checkpoint(engine, run_dir: Path, state: TrainerState, keep: int) -> Path:
    """Collective: every rank calls it. Keeps the newest `keep` checkpoints."""
    checkpoints_dir = run_dir / CHECKPOINTS_DIR
    tag = checkpoint_tag(state.step)
    tag_dir = checkpoints_dir / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), tag_dir / f"rng_rank{dist.get_rank()}.pt")
    engine.save_checkpoint(str(checkpoints_dir), tag=tag, client_state={"trainer_state": asdict(state)})
    dist.barrier()
    if dist.get_rank() == 0:
        tags = sorted(p for p in checkpoints_dir.glob(f"{TAG_PREFIX}*") if p.is_dir())
        for old in tags[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return tag_dir


def load_checkpoint(engine, point: ResumePoint, tp_size: int) -> TrainerState:
    """Collective. Restores module, optimizer, lr schedule, this rank's RNG; returns the trainer state."""
    saved_tp = _tensor_parallel_size_of(point.checkpoints_dir / point.tag)
    if saved_tp is not None and saved_tp != tp_size:
        raise ConfigError(
            f"train.resume: checkpoint {point.checkpoints_dir / point.tag} holds parallel.tp={saved_tp} shards, this "
            f"run has parallel.tp={tp_size}; resume with parallel.tp={saved_tp} (the data-parallel size may change)"
        )
    path, client_state = engine.load_checkpoint(str(point.checkpoints_dir), tag=point.tag)
    if path is None or client_state is None or "trainer_state" not in client_state:
        raise ValueError(f"train.resume: could not load checkpoint {point.checkpoints_dir / point.tag}")
    rng_file = point.checkpoints_dir / point.tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return TrainerState(**client_state["trainer_state"])


def export_hf(engine, run_dir: Path, parallel_groups: ParallelGroups) -> Path | None:
    """Collective. Rank 0 writes the trained weights as one unsharded HF Qwen3.5 checkpoint (ZeRO-3
    gathers the partitions first, tensor parallelism the head shards)."""
    model = engine.module
    output = run_dir / HF_EXPORT_DIR
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            save_hf_checkpoint(model, parallel_groups, output)
    else:
        save_hf_checkpoint(model, parallel_groups, output)
    dist.barrier()
    return output if dist.get_rank() == 0 else None


def _tensor_parallel_size_of(tag_dir: Path) -> int | None:
    """How many tensor-parallel ranks wrote a DeepSpeed checkpoint: one model file per rank,
    named ...mp_rank_NN_model_states.pt."""
    ranks = {path.name.split("mp_rank_")[1][:2] for path in tag_dir.glob("*mp_rank_*_model_states.pt")}
    return len(ranks) or None


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
