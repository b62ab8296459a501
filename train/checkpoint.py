"""DeepSpeed checkpoints of a run (model, optimizer, schedule, trainer state, per-rank RNG) and
the HF export of the final weights.

Layout of run_dir/checkpoints/:
  step_00000100/          one complete checkpoint: DeepSpeed's files, rng_rank{r}.pt, manifest.json
  .tmp-step_00000100/     a save in progress (or one that died); never read, removed by the next save
  latest                  the tag of the newest complete checkpoint (DeepSpeed's format: the bare tag)

A save writes everything under the temporary name, every rank fsyncs, then rank 0 writes
manifest.json last, renames the directory to its final name and replaces `latest` atomically, so
a directory with a final name and a manifest that checks out is a whole checkpoint. The manifest
lists every file with its size (crc32 for files up to CHECKSUM_MAX_BYTES), the run id, the step
and a save sequence number (the order the saves of this directory happened in).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from qwen_hybrid.checkpoint_io import fsync_dir, fsync_file
from qwen_hybrid.parallel import ParallelGroups, save_hf_checkpoint
from train.config import ConfigError

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
HF_EXPORT_DIR = "hf_final"
TAG_PREFIX = "step_"
TEMP_PREFIX = ".tmp-"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "train-checkpoint-manifest/1"
# Files up to this size get a crc32 in the manifest. Bigger ones (model and optimizer shards) get
# their size only: truncation shows in the size, and re-reading gigabytes on every save and resume
# costs more than the rare same-size corruption, which load_checkpoint still reports by file.
CHECKSUM_MAX_BYTES = 64 * 2**20
_TAG_PATTERN = re.compile(rf"{TAG_PREFIX}(\d+)")
_CHUNK = 8 * 2**20

log = logging.getLogger("train")


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt or unloadable; the message starts with its path."""


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps completed
    data_position: int = 0  # global micro-batches consumed (all data-parallel ranks together)
    tokens_seen: int = 0
    run_id: str = ""  # set once at a fresh start (new_run_id()); pruning only touches this run's checkpoints


@dataclass
class ResumePoint:
    run_dir: Path
    checkpoints_dir: Path
    tag: str


def checkpoint_tag(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def new_run_id() -> str:
    """A fresh run id, the same on every rank (collective once torch.distributed is up)."""
    chosen = [uuid.uuid4().hex]
    if _distributed():
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


# ---------------------------------------------------------------------------------------------
# finding a checkpoint to resume


def find_resume_point(resume: str, run_dir: str | None) -> ResumePoint | None:
    """Where `train.resume` points: 'auto' (run_dir's newest usable checkpoint, or None when it
    has no checkpoint at all), a run directory, its checkpoints directory, or one checkpoint (tag)
    directory. Directories are walked back from the newest save to the newest one whose manifest
    checks out; the skipped ones are logged. Collective once torch.distributed is up: rank 0
    decides, so every rank loads the same checkpoint."""
    if not _distributed():
        return _find_resume_point(resume, run_dir)
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = _find_resume_point(resume, run_dir)
        except Exception as error:  # the other ranks raise it too instead of waiting in a collective
            outcome[0] = error
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _find_resume_point(resume: str, run_dir: str | None) -> ResumePoint | None:
    if resume == "auto":
        if run_dir is None:
            raise ValueError("train.resume='auto' needs run_dir=PATH: it resumes that directory's newest checkpoint")
        return _newest_usable(Path(run_dir) / CHECKPOINTS_DIR, "train.resume='auto'")
    path = Path(resume)
    what = f"train.resume={resume!r}"
    if (path / CHECKPOINTS_DIR).is_dir():
        checkpoints_dir = path / CHECKPOINTS_DIR
    elif _holds_checkpoints(path):
        checkpoints_dir = path
    elif (path / MANIFEST_FILE).is_file() or any(path.glob("*model_states.pt")):
        _check_named_checkpoint(path, what)
        return ResumePoint(path.parent.parent, path.parent, path.name)
    else:
        checkpoints_dir = None
    point = _newest_usable(checkpoints_dir, what) if checkpoints_dir is not None else None
    if point is None:
        raise ValueError(
            f"{what}: no checkpoint there (expected a run directory with {CHECKPOINTS_DIR}/{TAG_PREFIX}*, its "
            f"{CHECKPOINTS_DIR} directory, or a {TAG_PREFIX}* checkpoint directory)"
        )
    return point


def _check_named_checkpoint(tag_dir: Path, what: str) -> None:
    if not (tag_dir / MANIFEST_FILE).is_file():
        if tag_dir.name.startswith(TEMP_PREFIX):
            raise CheckpointError(f"{what}: {tag_dir} is a save that did not finish (no {MANIFEST_FILE})")
        # Saves before manifests existed: accepted only when named, since nothing tells a whole one
        # from a save that died halfway.
        log.warning(f"{what}: {tag_dir} has no {MANIFEST_FILE}; loading it unverified")
        return
    try:
        verify_checkpoint(tag_dir)
    except CheckpointError as error:
        raise CheckpointError(f"{what}: checkpoint {tag_dir} is not usable: {error}") from None


def _newest_usable(checkpoints_dir: Path, what: str) -> ResumePoint | None:
    tag_dirs = _tag_dirs(checkpoints_dir)
    latest = _read_latest(checkpoints_dir)
    if not tag_dirs:
        if latest is not None:
            log.warning(f"{checkpoints_dir / LATEST_FILE} names {latest!r}, which does not exist; no checkpoint there")
        return None
    skipped: list[tuple[Path, str]] = []
    ordered: list[tuple[tuple[int, int], Path]] = []
    for tag_dir in tag_dirs:
        try:
            manifest = read_manifest(tag_dir)
        except CheckpointError as error:
            skipped.append((tag_dir, str(error)))
            continue
        ordered.append(((manifest["sequence"], manifest["step"]), tag_dir))
    chosen = None
    for _, tag_dir in sorted(ordered, reverse=True):  # the newest save first
        try:
            verify_checkpoint(tag_dir)
        except CheckpointError as error:
            skipped.append((tag_dir, str(error)))
            continue
        chosen = tag_dir
        break
    if chosen is None:
        reasons = "; ".join(reason for _, reason in skipped)
        raise CheckpointError(
            f"{what}: no usable checkpoint in {checkpoints_dir} (expected a {TAG_PREFIX}* directory whose "
            f"{MANIFEST_FILE} checks out): {reasons}. Name one checkpoint directory in train.resume to load it "
            f"without a manifest, or move them away to start fresh"
        )
    for tag_dir, reason in skipped:
        log.warning(f"{what}: skipping {tag_dir.name}: {reason}")
    if latest != chosen.name:
        log.warning(f"{what}: {checkpoints_dir / LATEST_FILE} names {latest!r}; resuming from {chosen.name}, the newest "
                    f"complete save")
    return ResumePoint(checkpoints_dir.parent, checkpoints_dir, chosen.name)


def read_manifest(tag_dir: Path) -> dict:
    """The manifest of a checkpoint directory, checked for form only (see verify_checkpoint)."""
    path = Path(tag_dir) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing (a save that did not finish, or one written before manifests existed)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error}); expected the JSON save_checkpoint writes") from None
    expected = {"format": str, "run_id": str, "step": int, "sequence": int, "files": dict}
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or any(
        not isinstance(manifest.get(key), kind) for key, kind in expected.items()
    ):
        raise CheckpointError(f"{path}: not a {MANIFEST_FORMAT} manifest (expected the keys {sorted(expected)})")
    return manifest


def verify_checkpoint(tag_dir: Path) -> dict:
    """The manifest, once every file it lists exists with the recorded size and crc32 (where
    recorded); CheckpointError naming the first file that does not."""
    tag_dir = Path(tag_dir)
    manifest = read_manifest(tag_dir)
    for name, entry in sorted(manifest["files"].items()):
        path = tag_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: missing; {MANIFEST_FILE} lists it with {entry['size']} bytes") from None
        if size != entry["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes, {MANIFEST_FILE} recorded {entry['size']} (truncated or rewritten after the save)"
            )
        if "crc32" in entry:
            crc = _crc32(path)
            if crc != entry["crc32"]:
                raise CheckpointError(
                    f"{path}: crc32 {crc}, {MANIFEST_FILE} recorded {entry['crc32']} (changed after the save)"
                )
    return manifest


# ---------------------------------------------------------------------------------------------
# saving


def save_checkpoint(
    engine, run_dir: Path, state: TrainerState, keep: int, *, checksum_max_bytes: int = CHECKSUM_MAX_BYTES
) -> Path:
    """Collective: every rank calls it. Writes checkpoints/step_NNNNNNNN atomically (see the module
    docstring), points `latest` at it, then keeps the newest `keep` complete checkpoints of this
    run (state.run_id; an empty one is replaced by a fresh id, in place). Returns the directory."""
    rank = dist.get_rank()
    check_engine_saves_atomically(engine)
    if not state.run_id:
        state.run_id = new_run_id()
    checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
    tag = checkpoint_tag(state.step)
    temp_dir, final_dir = checkpoints_dir / f"{TEMP_PREFIX}{tag}", checkpoints_dir / tag
    def prepare():
        # one save at a time per run: any temporary directory left now is from a save that died
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        _remove_temporaries(checkpoints_dir)
        temp_dir.mkdir()

    _rank_zero_succeeds(prepare if rank == 0 else None, f"preparing {temp_dir}")  # also the barrier

    # a rank that fails here must not leave the others waiting in DeepSpeed's collectives
    _all_ranks_succeed(lambda: torch.save(_rng_state(), temp_dir / f"rng_rank{rank}.pt"), f"RNG state into {temp_dir}")
    engine.save_checkpoint(
        str(checkpoints_dir), tag=temp_dir.name, client_state={"trainer_state": asdict(state)}, save_latest=False
    )  # ends in a barrier: every rank's files are written and closed
    # Each rank fsyncs every file, so each writer's own fsync is among them, whichever rank wrote what
    # (on network filesystems a reader's fsync does not flush a writer's cache).
    _all_ranks_succeed(lambda: _fsync_files(temp_dir), f"fsync of {temp_dir}")
    def commit():
        _commit(checkpoints_dir, temp_dir, final_dir, state, keep, checksum_max_bytes)

    _rank_zero_succeeds(commit if rank == 0 else None, f"commit of {final_dir}")
    return final_dir


def check_engine_saves_atomically(engine) -> None:
    """ConfigError for DeepSpeed checkpoint settings these saves cannot make atomic; the trainer
    calls it right after building the engine, before the first step."""
    if getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)():
        raise ConfigError(
            f"deepspeed.overrides.checkpoint: DeepSpeed's checkpoint engine {type(engine.checkpoint_engine).__name__} "
            "writes after save_checkpoint returns; expected the default (synchronous) torch checkpoint engine"
        )
    if getattr(engine, "use_node_local_storage", lambda: False)():
        raise ConfigError(
            "deepspeed.overrides.checkpoint.use_node_local_storage=true: expected false (rank 0 lists, verifies and "
            "renames every rank's files, so all ranks must write into the shared run directory)"
        )


def _commit(checkpoints_dir, temp_dir, final_dir, state, keep, checksum_max_bytes) -> None:
    """Rank 0, after every rank's files are durable: manifest, rename, latest, pruning."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "run_id": state.run_id,
        "step": state.step,
        "tag": final_dir.name,
        "sequence": 1 + max((m["sequence"] for _, m in _manifests(checkpoints_dir)), default=0),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": dist.get_world_size(),
        "trainer_state": asdict(state),
        "checksum": f"crc32 of files up to {checksum_max_bytes} bytes",
        "files": _describe_files(temp_dir, checksum_max_bytes),
    }
    _write_durably(temp_dir / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
    for directory in sorted({p.parent for p in temp_dir.rglob("*")} | {temp_dir}, reverse=True):
        fsync_dir(directory)
    aside = None
    if final_dir.exists():
        # the same step saved again (another run's, a corrupt one, or a re-save): the new one wins
        aside = checkpoints_dir / f"{TEMP_PREFIX}replaced-{final_dir.name}"
        log.warning(f"{final_dir}: replacing the existing directory ({_describe(final_dir)}) with the new checkpoint")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final_dir, aside)
    try:
        os.rename(temp_dir, final_dir)
    except BaseException:
        if aside is not None:  # the old one back under its name: a later save would delete the aside copy
            os.rename(aside, final_dir)
        raise
    fsync_dir(checkpoints_dir)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _write_durably(checkpoints_dir / LATEST_FILE, final_dir.name)
    _prune(checkpoints_dir, state.run_id, final_dir.name, keep)


def _prune(checkpoints_dir: Path, run_id: str, new_tag: str, keep: int) -> None:
    """Delete this run's complete checkpoints beyond the newest `keep` saves (the new one counts).
    Incomplete or corrupt ones, other runs' and the one `latest` names are never touched."""
    protected = {new_tag, _read_latest(checkpoints_dir)}
    complete = []
    for tag_dir, manifest in _manifests(checkpoints_dir):
        if tag_dir.name in protected or manifest["run_id"] != run_id:
            continue
        try:
            verify_checkpoint(tag_dir)
        except CheckpointError as error:
            log.warning(f"not pruning {tag_dir}: {error}; delete it by hand once it is not needed")
            continue
        complete.append(((manifest["sequence"], manifest["step"]), tag_dir))
    for _, tag_dir in sorted(complete, reverse=True)[max(keep, 1) - 1:]:
        # out of the final names first, so a deletion cut short leaves no half checkpoint behind
        doomed = checkpoints_dir / f"{TEMP_PREFIX}pruned-{tag_dir.name}"
        try:
            os.rename(tag_dir, doomed)
            shutil.rmtree(doomed)
        except OSError as error:
            log.warning(f"could not prune {tag_dir}: {error}")


def _remove_temporaries(checkpoints_dir: Path) -> None:
    for path in checkpoints_dir.glob(f"{TEMP_PREFIX}*"):
        log.info(f"removing {path}, left by a save that did not finish")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _describe_files(tag_dir: Path, checksum_max_bytes: int) -> dict:
    files = {}
    for path in sorted(p for p in tag_dir.rglob("*") if p.is_file()):
        name = path.relative_to(tag_dir).as_posix()
        if name == MANIFEST_FILE:
            continue
        size = path.stat().st_size
        files[name] = {"size": size}
        if size <= checksum_max_bytes:
            files[name]["crc32"] = _crc32(path)
    return files


def _describe(tag_dir: Path) -> str:
    try:
        manifest = read_manifest(tag_dir)
    except CheckpointError:
        return f"no valid {MANIFEST_FILE}"
    return f"step {manifest['step']} of run {manifest['run_id'] or '(none)'}"


# ---------------------------------------------------------------------------------------------
# loading


def load_checkpoint(engine, point: ResumePoint, tp_size: int) -> TrainerState:
    """Collective. Restores module, optimizer, lr schedule, this rank's RNG; returns the trainer state.
    A file that fails to load raises CheckpointError naming the checkpoint directory and the file."""
    tag_dir = point.checkpoints_dir / point.tag
    if _distributed():
        # ranks that looked for a resume point on their own must still load one and the same
        chosen = [None] * dist.get_world_size()
        dist.all_gather_object(chosen, str(tag_dir))
        if len(set(chosen)) > 1:
            raise CheckpointError(
                f"{tag_dir}: the ranks chose different checkpoints to resume ({', '.join(sorted(set(chosen)))}); "
                f"expected one for all (call find_resume_point after torch.distributed is up, or on a shared run_dir)"
            )
    _check_tensor_parallel_size(tag_dir, tp_size)
    reading = [None]
    checkpoint_engine = engine.checkpoint_engine
    own_load = checkpoint_engine.__dict__.get("load")
    class_load = checkpoint_engine.load

    def load_noting_the_file(path, *args, **kwargs):  # DeepSpeed reads every file through this
        reading[0] = path
        loaded = class_load(path, *args, **kwargs)
        reading[0] = None
        return loaded

    checkpoint_engine.load = load_noting_the_file
    try:
        path, client_state = engine.load_checkpoint(str(point.checkpoints_dir), tag=point.tag)
        rng_file = tag_dir / f"rng_rank{dist.get_rank()}.pt"
        reading[0] = rng_file
        rng_state = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
        reading[0] = None
    except Exception as error:
        culprit = Path(reading[0]).name if reading[0] is not None else "its DeepSpeed files"
        raise CheckpointError(
            f"{tag_dir}: could not load {culprit}: {type(error).__name__}: {error}{_manifest_verdict(tag_dir)}"
        ) from error
    finally:
        if own_load is None:
            del checkpoint_engine.load
        else:
            checkpoint_engine.load = own_load
    if path is None or client_state is None or "trainer_state" not in client_state:
        raise CheckpointError(
            f"{tag_dir}: DeepSpeed loaded no client state with 'trainer_state' (expected a checkpoint that "
            f"save_checkpoint wrote){_manifest_verdict(tag_dir)}"
        )
    if rng_state is not None:
        _set_rng_state(rng_state)
    known = {f.name for f in fields(TrainerState)}
    return TrainerState(**{k: v for k, v in client_state["trainer_state"].items() if k in known})


def check_resume_point(point: ResumePoint, tp_size: int, steps: int, world_size: int) -> None:
    """ConfigError where this run cannot continue from `point`: checked before anything is written."""
    tag_dir = point.checkpoints_dir / point.tag
    _check_tensor_parallel_size(tag_dir, tp_size)
    saved_partitions = _optimizer_partitions_of(tag_dir)
    if saved_partitions is not None and saved_partitions != world_size // tp_size:
        raise ConfigError(
            f"train.resume: checkpoint {tag_dir} holds ZeRO optimizer state partitioned over {saved_partitions} "
            f"rank(s) (the world size over parallel.tp), this run has {world_size // tp_size} (world size "
            f"{world_size}, parallel.tp={tp_size}); DeepSpeed cannot repartition it: resume with world size "
            f"{saved_partitions * tp_size}"
        )
    if (tag_dir / MANIFEST_FILE).is_file():
        saved_step = read_manifest(tag_dir)["step"]
        if saved_step > steps:
            raise ConfigError(
                f"train.steps={steps}: the checkpoint to resume ({tag_dir}) is at step {saved_step}; expected "
                f"train.steps >= {saved_step} (the schedule's length; raise it to train on)"
            )


def _check_tensor_parallel_size(tag_dir: Path, tp_size: int) -> None:
    saved_tp = _tensor_parallel_size_of(tag_dir)
    if saved_tp is not None and saved_tp != tp_size:
        raise ConfigError(
            f"train.resume: checkpoint {tag_dir} holds parallel.tp={saved_tp} shards, this "
            f"run has parallel.tp={tp_size}; resume with parallel.tp={saved_tp}"
        )


def _manifest_verdict(tag_dir: Path) -> str:
    try:
        verify_checkpoint(tag_dir)
    except CheckpointError as error:
        return f" ({error})"
    return ""


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


# ---------------------------------------------------------------------------------------------
# helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _tag_dirs(checkpoints_dir: Path) -> list[Path]:
    if not checkpoints_dir.is_dir():
        return []
    return sorted(p for p in checkpoints_dir.iterdir() if _TAG_PATTERN.fullmatch(p.name) and p.is_dir())


def _holds_checkpoints(path: Path) -> bool:
    return bool(_tag_dirs(path)) or (path / LATEST_FILE).is_file()


def _manifests(checkpoints_dir: Path) -> list[tuple[Path, dict]]:
    found = []
    for tag_dir in _tag_dirs(checkpoints_dir):
        try:
            found.append((tag_dir, read_manifest(tag_dir)))
        except CheckpointError:
            pass
    return found


def _read_latest(checkpoints_dir: Path) -> str | None:
    try:
        return (checkpoints_dir / LATEST_FILE).read_text().strip()
    except OSError:
        return None


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _fsync_files(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fsync_file(path)


def _write_durably(path: Path, text: str) -> None:
    """Replace `path` atomically: a temporary file, fsynced, renamed over it, the directory fsynced."""
    temporary = path.parent / f"{TEMP_PREFIX}{path.name}"
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def _all_ranks_succeed(work, what: str) -> None:
    """Run `work` on every rank; if any rank fails, every rank raises (none waits in a collective)."""
    try:
        work()
        failure = None
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
        own = error
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    if failure is not None:
        raise own
    bad = [(r, f) for r, f in enumerate(failures) if f is not None]
    if bad:
        raise CheckpointError(f"{what} failed on rank {bad[0][0]}: {bad[0][1]}")


def _rank_zero_succeeds(work, what: str) -> None:
    """Rank 0 runs `work`; every rank raises if it failed."""
    outcome = [None]
    own = None
    if work is not None:
        try:
            work()
        except BaseException as error:
            outcome[0], own = f"{type(error).__name__}: {error}", error
    dist.broadcast_object_list(outcome, src=0)
    if own is not None:
        raise own
    if outcome[0] is not None:
        raise CheckpointError(f"{what} failed on rank 0: {outcome[0]}")


def _distinct_ranks(tag_dir: Path, files: str, prefix: str) -> int | None:
    """How many distinct rank numbers follow `prefix` in the names of a checkpoint's `files` (a glob)."""
    ranks = {path.name.split(prefix)[1].split("_")[0] for path in tag_dir.glob(files)}
    return len(ranks) or None


def _tensor_parallel_size_of(tag_dir: Path) -> int | None:
    """How many tensor-parallel ranks wrote a DeepSpeed checkpoint: one model file per rank,
    named ...mp_rank_NN_model_states.pt."""
    return _distinct_ranks(tag_dir, "*mp_rank_*_model_states.pt", "mp_rank_")


def _optimizer_partitions_of(tag_dir: Path) -> int | None:
    """Over how many ranks ZeRO partitioned a checkpoint's optimizer state (data x context parallel):
    one file per partition and tensor-parallel rank, named ...zero_pp_rank_N_mp_rank_NN_optim_states.pt."""
    return _distinct_ranks(tag_dir, "*zero_pp_rank_*_optim_states.pt", "zero_pp_rank_")


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
