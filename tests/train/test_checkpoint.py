"""train/checkpoint.py against a tiny real DeepSpeed engine (ZeRO-2, fp32, CPU, one gloo rank, in
this process): saves that fail part way, another run's leftovers, a truncated newest checkpoint,
where `latest` points, and what pruning keeps."""
import json
import logging
import os
import socket
from contextlib import closing

import pytest
import torch
import torch.distributed as dist

from train import checkpoint
from train.checkpoint import (
    CheckpointError,
    TrainerState,
    find_resume_point,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def single_rank():
    """One gloo rank, set up the way train/pretrain.py's init_distributed does for CPU runs."""
    import deepspeed
    import deepspeed.ops

    created = not dist.is_initialized()
    if created:
        with closing(socket.socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # no JIT build of DeepSpeed's shared-memory allreduce (a minute of compiling)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    if created:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_engine(seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def train_step(engine):
    loss = engine(torch.randn(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()


@pytest.fixture
def engine(single_rank):
    return make_engine()


def save(engine, run_dir, step, run_id="run-a", keep=10):
    train_step(engine)
    return save_checkpoint(engine, run_dir, TrainerState(step=step, data_position=2 * step, run_id=run_id), keep)


def tags(run_dir):
    """`latest` and the checkpoint directories (DeepSpeed also copies its zero_to_*.py scripts there)."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name == "latest" or p.name.startswith("step_"))


def latest(run_dir):
    return (run_dir / "checkpoints" / "latest").read_text()


def assert_latest_is_whole(run_dir):
    target = run_dir / "checkpoints" / latest(run_dir)
    assert target.is_dir(), f"latest names {target.name}, which is missing"
    verify_checkpoint(target)


def model_file(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"


def test_round_trip_loads_under_the_final_name(engine, tmp_path):
    tag_dir = save(engine, tmp_path, 3)
    assert tag_dir == tmp_path / "checkpoints" / "step_00000003" and latest(tmp_path) == "step_00000003"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    assert manifest["run_id"] == "run-a" and manifest["step"] == 3 and manifest["sequence"] == 1
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank0.pt"} <= set(
        manifest["files"]
    )
    assert all("crc32" in entry for entry in manifest["files"].values())  # all small here
    weights = [p.detach().clone() for p in engine.module.parameters()]
    expected_draw = torch.rand(3)

    other = make_engine(seed=1)  # different weights, fresh optimizer
    state = load_checkpoint(other, find_resume_point("auto", str(tmp_path)), tp_size=1)
    assert state == TrainerState(step=3, data_position=6, run_id="run-a")
    for saved, loaded in zip(weights, other.module.parameters()):
        torch.testing.assert_close(saved, loaded.detach())
    assert other.optimizer.state_dict()["base_optimizer_state"]["state"]  # Adam moments came back
    torch.testing.assert_close(torch.rand(3), expected_draw)  # the RNG as it was at the save


def test_empty_run_id_gets_a_fresh_one(engine, tmp_path):
    state = TrainerState(step=1)
    save_checkpoint(engine, tmp_path, state, keep=1)
    assert len(state.run_id) == 32
    assert json.loads((tmp_path / "checkpoints/step_00000001/manifest.json").read_text())["run_id"] == state.run_id


def test_failed_save_keeps_latest_and_the_previous_checkpoints(engine, tmp_path, monkeypatch):
    save(engine, tmp_path, 4, keep=2)
    save(engine, tmp_path, 5, keep=2)
    real_save = engine.checkpoint_engine.save

    def dies_in_the_optimizer_shard(state_dict, path):
        if "optim_states" in path:
            with open(path, "wb") as file:
                file.write(b"PK\x03\x04 half a shard")
            raise OSError(28, "No space left on device")
        real_save(state_dict, path)

    monkeypatch.setattr(engine.checkpoint_engine, "save", dies_in_the_optimizer_shard)
    with pytest.raises(OSError, match="No space left"):
        save(engine, tmp_path, 6, keep=1)
    assert tags(tmp_path) == ["latest", "step_00000004", "step_00000005"]
    assert latest(tmp_path) == "step_00000005"
    for step in (4, 5):
        verify_checkpoint(tmp_path / "checkpoints" / f"step_{step:08d}")
    assert find_resume_point("auto", str(tmp_path)).tag == "step_00000005"

    # the retry removes the dead save's leftovers; keep=2 keeps steps 5 and 6 only
    monkeypatch.setattr(engine.checkpoint_engine, "save", real_save)
    save(engine, tmp_path, 6, keep=2)
    assert tags(tmp_path) == ["latest", "step_00000005", "step_00000006"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert_latest_is_whole(tmp_path)


def test_a_half_written_folder_of_the_old_layout_is_skipped_and_never_pruned(engine, tmp_path, caplog):
    save(engine, tmp_path, 4, keep=1)
    half = tmp_path / "checkpoints" / "step_00000009"  # what the old save left when it died
    half.mkdir()
    torch.save({}, half / "rng_rank0.pt")
    save(engine, tmp_path, 5, keep=1)
    assert tags(tmp_path) == ["latest", "step_00000005", "step_00000009"]
    with caplog.at_level(logging.WARNING, logger="train"):
        assert find_resume_point("auto", str(tmp_path)).tag == "step_00000005"
    assert "skipping step_00000009" in caplog.text and "manifest.json: missing" in caplog.text


def test_a_fresh_run_beside_an_older_runs_checkpoint(engine, tmp_path):
    save(engine, tmp_path, 6, run_id="old-run", keep=1)
    fresh = make_engine(seed=2)
    save(fresh, tmp_path, 2, run_id="new-run", keep=1)
    assert tags(tmp_path) == ["latest", "step_00000002", "step_00000006"]  # neither deleted
    assert latest(tmp_path) == "step_00000002"
    point = find_resume_point("auto", str(tmp_path))
    assert point.tag == "step_00000002"  # the newest save, not the higher step of the other run
    assert load_checkpoint(make_engine(), point, tp_size=1).run_id == "new-run"

    save(fresh, tmp_path, 4, run_id="new-run", keep=1)
    assert tags(tmp_path) == ["latest", "step_00000004", "step_00000006"]  # its own step 2 pruned only
    save(fresh, tmp_path, 6, run_id="new-run", keep=1)  # the same tag: the new run's replaces it
    assert tags(tmp_path) == ["latest", "step_00000006"]
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_00000006")["run_id"] == "new-run"


def test_truncated_newest_checkpoint_resumes_from_the_previous_one(engine, tmp_path, caplog):
    save(engine, tmp_path, 4)
    save(engine, tmp_path, 6)
    corrupt = model_file(tmp_path, 6)
    corrupt.write_bytes(corrupt.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="train"):
        point = find_resume_point("auto", str(tmp_path))
    assert point.tag == "step_00000004"
    assert f"skipping step_00000006: {corrupt}: 100 bytes, manifest.json recorded" in caplog.text
    assert find_resume_point(str(tmp_path), None).tag == "step_00000004"  # the run directory, named
    assert find_resume_point(str(tmp_path / "checkpoints"), None).tag == "step_00000004"

    # named explicitly: an error naming the directory and the file
    with pytest.raises(CheckpointError, match=f"checkpoint {corrupt.parent} is not usable: {corrupt}: 100 bytes"):
        find_resume_point(str(corrupt.parent), None)
    # loading it anyway: the error starts with the checkpoint and names the file
    bad_point = checkpoint.ResumePoint(tmp_path, tmp_path / "checkpoints", "step_00000006")
    with pytest.raises(CheckpointError, match=f"^{corrupt.parent}: could not load mp_rank_00_model_states.pt: "):
        load_checkpoint(make_engine(), bad_point, tp_size=1)

    # resumed from step 4 with keep=1: step 4 goes, the corrupt step 6 stays but does not count
    resumed = make_engine()
    state = load_checkpoint(resumed, point, tp_size=1)
    save(resumed, tmp_path, 5, run_id=state.run_id, keep=1)
    assert tags(tmp_path) == ["latest", "step_00000005", "step_00000006"]
    assert find_resume_point("auto", str(tmp_path)).tag == "step_00000005"


def test_same_size_corruption_of_a_small_file_is_caught_by_its_crc(engine, tmp_path):
    save(engine, tmp_path, 1)
    rng = tmp_path / "checkpoints" / "step_00000001" / "rng_rank0.pt"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rng.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"^{rng}: crc32 "):
        verify_checkpoint(rng.parent)


def test_no_usable_checkpoint_is_an_error_naming_each(engine, tmp_path):
    assert find_resume_point("auto", str(tmp_path)) is None  # nothing at all: a fresh start
    (tmp_path / "checkpoints" / ".tmp-step_00000001").mkdir(parents=True)  # a save that died: still fresh
    assert find_resume_point("auto", str(tmp_path)) is None
    save(engine, tmp_path, 2)
    save(engine, tmp_path, 3)
    model_file(tmp_path, 2).unlink()
    (tmp_path / "checkpoints" / "step_00000003" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="no usable checkpoint in") as error:
        find_resume_point("auto", str(tmp_path))
    assert f"{model_file(tmp_path, 2)}: missing" in str(error.value)
    assert "step_00000003/manifest.json: unreadable" in str(error.value)


FAILURE_POINTS = ["deepspeed", "fsync", "manifest", "rename", "latest", "prune"]


@pytest.mark.parametrize("failure", FAILURE_POINTS)
def test_latest_never_names_a_missing_checkpoint(engine, tmp_path, monkeypatch, failure):
    save(engine, tmp_path, 1, keep=1)
    boom = OSError(5, f"injected failure at {failure}")

    def fail(*args, **kwargs):
        raise boom

    if failure == "deepspeed":
        monkeypatch.setattr(engine.checkpoint_engine, "save", fail)
    elif failure == "fsync":
        monkeypatch.setattr(checkpoint, "_fsync_files", fail)
    elif failure in ("manifest", "latest"):
        real = checkpoint._write_durably
        name = "manifest.json" if failure == "manifest" else "latest"
        monkeypatch.setattr(checkpoint, "_write_durably", lambda p, t: fail() if p.name == name else real(p, t))
    elif failure == "rename":
        real_rename = os.rename
        monkeypatch.setattr(checkpoint.os, "rename", lambda a, b: fail() if ".tmp-step" in str(a) else real_rename(a, b))
    elif failure == "prune":
        monkeypatch.setattr(checkpoint.shutil, "rmtree", fail)

    if failure == "prune":
        save(engine, tmp_path, 2, keep=1)  # a deletion that fails is only a warning
    else:
        with pytest.raises(OSError, match="injected failure"):
            save(engine, tmp_path, 2, keep=1)
    assert_latest_is_whole(tmp_path)
    point = find_resume_point("auto", str(tmp_path))
    verify_checkpoint(point.checkpoints_dir / point.tag)
    # renamed but `latest` not yet replaced: the newer complete save is the one to resume
    assert point.tag == ("step_00000002" if failure in ("latest", "prune") else "step_00000001")
    monkeypatch.undo()
    save(engine, tmp_path, 3, keep=1)
    assert tags(tmp_path) == ["latest", "step_00000003"] and latest(tmp_path) == "step_00000003"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_pruning_keeps_the_newest_complete_checkpoints_of_this_run(engine, tmp_path):
    save(engine, tmp_path, 10, run_id="other-run")
    half = tmp_path / "checkpoints" / "step_00000011"
    half.mkdir()
    torch.save({}, half / "rng_rank0.pt")
    for step in range(1, 6):
        save(engine, tmp_path, step, keep=3)
        assert_latest_is_whole(tmp_path)
    assert tags(tmp_path) == ["latest", "step_00000003", "step_00000004", "step_00000005", "step_00000010",
                              "step_00000011"]
    save(engine, tmp_path, 6, keep=1)
    assert tags(tmp_path) == ["latest", "step_00000006", "step_00000010", "step_00000011"]
