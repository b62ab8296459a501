"""What a run does when things go wrong: config and environment errors before any side effect,
divergence, a torn metrics line, a run directory that already holds a run. (Processes killed with
SIGKILL: tests/train/test_train.py, beside the uninterrupted run it compares with.)"""
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from train.checkpoint import find_resume_point
from train.config import ConfigError
from train.pretrain import preflight
from train_runs import PRETRAIN, REPO, pretrain_env, run_command, smoke_overrides, step_records


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("failures")


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("pretrain", overrides=["experiment=cpu_smoke", *overrides])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer to GPU backends")
@pytest.mark.parametrize("override, key", [
    ("model.gdn_backend=tilelang", "model.gdn_backend='tilelang': backend 'tilelang' needs a CUDA GPU"),
    ("benchmark.compare_backends=[torch,fla]", "benchmark.compare_backends[1]='fla': backend 'fla' needs a CUDA GPU"),
    ("model.conv_backend=tilelang", "model.conv_backend='tilelang': backend 'tilelang' needs a CUDA GPU"),
    ("model.attention_backend=fa4", "model.attention_backend='fa4': FlashAttention-4 runs on CUDA devices, got cpu"),
])
def test_backend_this_machine_cannot_run_is_a_config_error(override, key):
    with pytest.raises(ConfigError) as error:
        preflight(_compose(override))
    assert str(error.value).startswith(key)


def test_schedule_dataset_and_resume_errors_name_their_key(tmp_path):
    cases = [
        (("train.warmup_steps=300",), "train.warmup_steps=300: expected <= train.steps=200"),
        (("data.embedded_documents=1", "train.tokens_per_micro_batch=8192", "train.seq_len=512"),
         "train.tokens_per_micro_batch=8192: the dataset (embedded corpus, data.embedded_documents=1) holds only"),
        ((f"train.resume={tmp_path}",), f"train.resume='{tmp_path}'"),
        (("train.overwrite=true", "train.resume=auto", f"run_dir={tmp_path}"), "train.overwrite=true: expected train.resume=null"),
        (("train.checkpoint_layers=2",), "train.checkpoint_layers=2: expected train.activation_checkpointing=true"),
        (("train.activation_checkpointing=true", "train.checkpoint_layers=9"), "train.checkpoint_layers=9: model tiny has 4 layers"),
        (("model.gdn_keep_for_backward=states",), "model.gdn_keep_for_backward='states': expected one of [True, 'inverse', False]"),
        (("train.recompute_attention=sometimes",), "train.recompute_attention='sometimes': expected true, false or auto"),
        (("train.recompute_attention=0",), "train.recompute_attention=0: expected true, false or auto"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as error:
            preflight(_compose(*overrides))
        assert str(error.value).startswith(message), (overrides, str(error.value))
    assert list(tmp_path.iterdir()) == []  # preflight writes nothing


def test_model_shape_errors_come_before_anything_is_written(tmp_path, monkeypatch):
    from train.pretrain import check_model_fits, model_config

    monkeypatch.setenv("WORLD_SIZE", "16")  # as a 16-rank launch would: the layout fits, the model does not
    run_dir = tmp_path / "run"
    cases = [
        (("model.vocab_size=100",), "model.vocab_size: the model has 100 token ids but the data uses 257"),
        (("parallel.cp=16",), "parallel.cp=16: model tiny does not split over 16 ranks"),
        (("+deepspeed.overrides.checkpoint.use_node_local_storage=true",),
         "deepspeed.overrides.checkpoint.use_node_local_storage=true: expected false"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as error:
            preflight(_compose(f"run_dir={run_dir}", *overrides))
        assert str(error.value).startswith(message), (overrides, str(error.value))
    assert not run_dir.exists()
    # the kernels' dtype and head dims, asked of the model's config (the CPU machine fails earlier, on the device)
    cfg = _compose("model.gdn_backend=tilelang")
    with pytest.raises(ConfigError, match=r"^model.gdn_backend='tilelang': the kernels take GDN head dims K = V = 128"):
        check_model_fits(cfg, model_config(cfg), 257)


def test_run_dir_holding_a_run_refuses_a_fresh_start(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n')
    with pytest.raises(ConfigError, match=r"^run_dir=.*holds an earlier run \(metrics.jsonl\).*train.resume=auto"):
        preflight(_compose(f"run_dir={tmp_path}"))
    preflight(_compose(f"run_dir={tmp_path}", "train.overwrite=true"))
    assert find_resume_point("auto", str(tmp_path)) is None
    preflight(_compose(f"run_dir={tmp_path}", "train.resume=auto"))


def test_config_error_exits_2_before_creating_anything(workdir):
    run_dir, cache = workdir / "never" / "run", workdir / "never" / "cache"
    result = subprocess.run(
        [sys.executable, PRETRAIN, "experiment=cpu_smoke", f"run_dir={run_dir}", f"data.cache_dir={cache}",
         "train.warmup_steps=1000"],
        cwd=REPO, env=pretrain_env(workdir), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("config error: train.warmup_steps=1000")
    assert not (workdir / "never").exists()


def test_divergence_stops_with_exit_3_and_keeps_the_last_good_checkpoint(workdir):
    run_dir = workdir / "diverged"
    result = run_command(
        [sys.executable, PRETRAIN] + smoke_overrides(
            workdir, run_dir, "train.steps=8", "train.lr=1e6", "train.checkpoint_every=1", "train.keep_checkpoints=1",
            "train.max_bad_steps=2", "logger.mode=disabled",
        ),
        workdir,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    records = step_records(run_dir)
    bad = [r["step"] for r in records if r["bad_step"]]
    assert bad == [records[-1]["step"] - 1, records[-1]["step"]], records
    assert "training diverged: 2 steps in a row" in result.stderr and f"-{records[-1]['step']})" in result.stderr
    last_good = bad[0] - 1
    point = find_resume_point("auto", str(run_dir))
    assert point.tag == f"step_{last_good:08d}", "the last good checkpoint must stay the one to resume from"
    assert not (run_dir / "hf_final").exists()
    # a run that ends inside a bad streak shorter than the limit: no checkpoint, no export, exit 3
    ended_bad = workdir / "ended_bad"
    result = run_command(
        [sys.executable, PRETRAIN] + smoke_overrides(
            workdir, ended_bad, "train.steps=2", "train.warmup_steps=1", "train.lr=1e6", "train.max_bad_steps=5",
            "logger.mode=disabled",
        ),
        workdir,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert "the run ended at step 2 in 1 bad step(s)" in result.stderr
    assert not (ended_bad / "hf_final").exists() and find_resume_point("auto", str(ended_bad)) is None


def test_torn_metrics_line_is_dropped_on_resume_and_a_rerun_needs_resume_or_overwrite(workdir):
    run_dir = workdir / "torn"
    first = run_command(
        [sys.executable, PRETRAIN] + smoke_overrides(
            workdir, run_dir, "train.steps=4", "train.stop_at_step=2", "logger.mode=disabled"), workdir)
    assert first.returncode == 0
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 3, "loss": 5.1')  # killed mid-write
    fresh = run_command([sys.executable, PRETRAIN] + smoke_overrides(
        workdir, run_dir, "train.steps=4", "logger.mode=disabled"), workdir)
    assert fresh.returncode == 2 and "holds an earlier run" in fresh.stderr
    resumed = run_command([sys.executable, PRETRAIN] + smoke_overrides(
        workdir, run_dir, "train.steps=4", "train.resume=auto", "logger.mode=disabled", "train.export_hf=false"),
        workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "line 4 is not JSON" in resumed.stderr
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]
    overwritten = run_command([sys.executable, PRETRAIN] + smoke_overrides(
        workdir, run_dir, "train.steps=2", "train.overwrite=true", "logger.mode=disabled", "train.export_hf=false"),
        workdir)
    assert overwritten.returncode == 0, overwritten.stderr[-3000:]
    assert [r["step"] for r in step_records(run_dir)] == [1, 2]
    # resuming a checkpoint past the schedule's end is refused before anything runs
    with pytest.raises(ConfigError, match=r"^train.steps=1: the checkpoint to resume .* is at step 2"):
        preflight(_compose(f"run_dir={run_dir}", "train.resume=auto", "train.steps=1", "train.warmup_steps=0"))
