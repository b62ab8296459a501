"""The training entry point on CPU: 2-rank ZeRO-2 runs on gloo (torchrun and the deepspeed launcher),
exact resume (after a stop, and after SIGKILL at any moment, a save included), SIGTERM checkpointing, metrics.jsonl / W&B offline files, per-kernel timing and the
backend comparison, and config errors that name their key."""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from train.checkpoint import find_resume_point
from train.config import ConfigError, deepspeed_config, validate_config
from train.schedule import lr_multiplier
from train_runs import PRETRAIN, REPO, pretrain_env, run_command, smoke_overrides, step_records, torchrun_command

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_gib"}
KERNEL_KEYS = {f"time/{g}_{p}_s" for g in ("gdn", "attention") for p in ("fwd", "bwd", "recompute")} | {"time/rest_s"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def straight_run(workdir):
    """8 steps on 2 ranks, ZeRO-2, W&B offline, a checkpoint every 4 steps (keeping 1)."""
    run_dir = workdir / "straight"
    result = run_command(
        torchrun_command(2) + [PRETRAIN] + smoke_overrides(
            workdir, run_dir, "train.steps=8", "train.checkpoint_every=4", "train.keep_checkpoints=1",
            "logger.mode=offline",
        ),
        workdir,
    )
    assert result.returncode == 0
    return run_dir


def test_two_ranks_zero2_train_and_log_every_step(straight_run):
    records = step_records(straight_run)
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        assert STEP_KEYS <= record.keys()
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0 and record["tokens_per_s"] > 0
        assert record["peak_memory_gib"] > 0
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert records[0]["lr"] == pytest.approx(3e-3 / 2)  # warmup step 1 of 2
    # the cosine ends at lr * min_lr_ratio on the last step
    assert records[-1]["lr"] == pytest.approx(3e-3 * 0.1)
    assert (straight_run / "config.yaml").is_file()


def test_wandb_offline_run_files_exist(straight_run):
    runs = list((straight_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))
    run_id = (straight_run / "wandb_run_id.txt").read_text().strip()
    assert runs[0].name.endswith(run_id)


def test_checkpoints_and_hf_export(straight_run):
    from qwen_hybrid import QwenHybridForCausalLM

    checkpoints = straight_run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000008"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000008"]  # keep_checkpoints=1
    assert {f"rng_rank{r}.pt" for r in (0, 1)} <= {p.name for p in (checkpoints / "step_00000008").iterdir()}
    model = QwenHybridForCausalLM.from_pretrained(straight_run / "hf_final", gdn_backend="torch")
    ids = torch.randint(0, 256, (1, 64))
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_init_from_the_exported_checkpoint_starts_where_training_ended(straight_run, workdir):
    run_dir = workdir / "init_from"
    result = run_command(
        [sys.executable, PRETRAIN] + smoke_overrides(
            workdir, run_dir, "train.steps=1", "train.warmup_steps=0", f"model.init_from={straight_run / 'hf_final'}",
            "train.lr=0", "logger.mode=disabled", "train.export_hf=false", "train.checkpoint_at_exit=false",
        ),
        workdir,
    )
    assert result.returncode == 0
    assert step_records(run_dir)[0]["loss"] < step_records(straight_run)[0]["loss"] - 0.3
    assert not (run_dir / "checkpoints").exists()


def test_zero3_trains_and_exports_gathered_weights(workdir):
    from qwen_hybrid import QwenHybridForCausalLM

    run_dir = workdir / "zero3"
    result = run_command(
        torchrun_command(2) + [PRETRAIN] + smoke_overrides(workdir, run_dir, "train.steps=2", "deepspeed=zero3", "logger.mode=disabled"),
        workdir,
    )
    assert result.returncode == 0
    assert [r["step"] for r in step_records(run_dir)] == [1, 2]
    model = QwenHybridForCausalLM.from_pretrained(run_dir / "hf_final")
    assert model.lm_head.weight.shape == (512, 64) and model.lm_head.weight.std() > 0.01


def test_stop_and_resume_reproduces_the_loss_trajectory(straight_run, workdir):
    run_dir = workdir / "resumed"
    port = 29500 + os.getpid() % 2000
    first_half = run_command(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), PRETRAIN]
        + smoke_overrides(workdir, run_dir, "train.steps=8", "train.stop_at_step=4", "logger.mode=disabled"),
        workdir,
    )
    assert first_half.returncode == 0
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]
    assert not (run_dir / "hf_final").exists()
    second_half = run_command(
        torchrun_command(2) + [PRETRAIN] + smoke_overrides(workdir, run_dir, "train.steps=8", f"train.resume={run_dir}",
                                               "logger.mode=disabled"),
        workdir,
    )
    assert second_half.returncode == 0
    straight, resumed = step_records(straight_run), step_records(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(straight, resumed):
        assert (a["step"], a["loss"], a["lr"], a["grad_norm"]) == (b["step"], b["loss"], b["lr"], b["grad_norm"])


KILL_STEPS = 8  # as straight_run, whose loss curve is the uninterrupted one


def _kill_run_overrides(workdir: Path, run_dir: Path, *extra: str) -> list[str]:
    return smoke_overrides(workdir, run_dir, f"train.steps={KILL_STEPS}", "train.checkpoint_every=2",
                           "train.keep_checkpoints=2", "logger.mode=disabled", "train.export_hf=false", *extra)


def _start(command: list[str], workdir: Path) -> subprocess.Popen:
    # its own session, so that one killpg reaches torchrun and both ranks at once, as a node failure would
    return subprocess.Popen(command, cwd=REPO, env=pretrain_env(workdir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _kill_when(process: subprocess.Popen, ready, timeout: float = 240) -> bool:
    """SIGKILL the whole process group as soon as ready() holds; False if the run ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if ready():
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
            return True
        time.sleep(0.005)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the run neither reached the kill point nor ended")
    return False


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_two_ranks_killed_at_random_moments_resume_onto_the_uninterrupted_loss_curve(straight_run, workdir):
    run_dir = workdir / "kill"
    command = torchrun_command(2) + [PRETRAIN]
    random_step = random.Random(os.getpid()).randint(3, 6)
    checkpoints = run_dir / "checkpoints"
    kill_points = [
        ("during a save", lambda: any(checkpoints.glob(".tmp-*"))),
        (f"at a random moment (step {random_step})", lambda: _steps_logged(run_dir) >= random_step),
        ("right after a save", lambda: any(checkpoints.glob("step_00000006"))),
    ]
    kills = []
    for name, ready in kill_points:
        resume = ["train.resume=auto"] if (run_dir / "metrics.jsonl").exists() else []
        process = _start(command + _kill_run_overrides(workdir, run_dir, *resume), workdir)
        if _kill_when(process, ready):
            kills.append(name)
            point = find_resume_point("auto", str(run_dir))
            assert point is None or (checkpoints / point.tag).is_dir()
    assert "during a save" in kills, "the kill during a save never happened: the test checked nothing there"
    final = run_command(command + _kill_run_overrides(workdir, run_dir, "train.resume=auto"), workdir)
    assert final.returncode == 0, final.stderr[-3000:]
    expected, resumed = step_records(straight_run), step_records(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, KILL_STEPS + 1)), kills
    for a, b in zip(expected, resumed):
        assert (a["step"], a["loss"], a["lr"], a["grad_norm"]) == (b["step"], b["loss"], b["lr"], b["grad_norm"]), kills
    assert not list(checkpoints.glob(".tmp-*")), "a later save must clear a killed save's temporary directory"


def test_sigterm_saves_a_checkpoint_and_stops(workdir):
    run_dir = workdir / "sigterm"
    command = [sys.executable, PRETRAIN] + smoke_overrides(
        workdir, run_dir, "train.steps=100000", "train.checkpoint_every=0", "logger.mode=disabled"
    )
    process = subprocess.Popen(command, cwd=REPO, env=pretrain_env(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    metrics_file = run_dir / "metrics.jsonl"
    while time.time() < deadline and process.poll() is None:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    assert process.poll() is None, process.stdout.read().decode()[-4000:]
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output.decode()[-4000:]
    last_step = step_records(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last_step:08d}"
    point = find_resume_point("auto", str(run_dir))
    assert point.tag == f"step_{last_step:08d}"
    # a requeued job: same run_dir, train.resume=auto picks the checkpoint up
    result = run_command(
        [sys.executable, PRETRAIN] + smoke_overrides(
            workdir, run_dir, f"train.steps={last_step + 1}", "train.resume=auto", "logger.mode=disabled",
            "train.export_hf=false",
        ),
        workdir,
    )
    assert result.returncode == 0
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, last_step + 2))


def test_kernel_timing_backend_comparison_and_step_profile(workdir):
    run_dir = workdir / "compare"
    result = run_command(
        [sys.executable, PRETRAIN] + smoke_overrides(
            workdir, run_dir, "train.steps=4", "benchmark.compare_backends=[torch,auto]", "benchmark.warmup_steps=0",
            "train.activation_checkpointing=true", "train.recompute_attention=auto", "logger.mode=offline",
            "train.export_hf=false", "benchmark.profile_step=3",
        ),
        workdir,
    )
    assert result.returncode == 0
    records = step_records(run_dir)
    assert [r["gdn_backend"] for r in records] == ["torch", "auto", "torch", "auto"]
    assert [r["attention_layers_kept"] for r in records] == [0] * 4  # auto on the CPU keeps recomputing
    for record in records:
        assert KERNEL_KEYS <= record.keys()
        for key in KERNEL_KEYS - {"time/rest_s"}:
            assert record[key] > 0, key  # recompute too: activation checkpointing is on
        assert sum(record[k] for k in KERNEL_KEYS) == pytest.approx(record["step_time_s"])
    assert records[1]["compare/auto_over_torch/step_time"] > 0
    assert records[1]["compare/auto_over_torch/gdn_bwd"] > 0
    assert not any(k.startswith("compare/") for k in records[3])  # its cycle holds the profiled step 3
    extra = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[-2:]]
    summary = extra[0]["comparison_summary"]
    run_summary = extra[1]["run_summary"]
    assert run_summary["timed_steps"] == 3 and run_summary["median_gdn_bwd_s"] > 0  # all but the profiled step
    assert run_summary["peak_memory_gib"] > 0, f"run_summary peak_memory_gib = {run_summary['peak_memory_gib']}, expected > 0"
    for backend in ("torch", "auto"):  # each backend's peak over its own steps
        assert run_summary[f"peak_memory_gib/{backend}"] == max(r["peak_memory_gib"] for r in records
                                                                if r["gdn_backend"] == backend)
    assert summary["columns"] == ["quantity", "torch_s", "auto_s", "auto_over_torch"]
    assert {row[0] for row in summary["rows"]} >= {"step_time", "gdn_fwd", "attention_bwd"}
    assert list(run_dir.glob("wandb/offline-run-*/files/media/table/compare/summary_*.table.json"))
    # step 3 ran under the profiler: its report names the model's ops; only that step logs profile keys
    report = (run_dir / "profile-step3.txt").read_text()
    assert report.startswith("wall ") and "host ops by self CPU time" in report and "aten::mm" in report
    assert [sorted(k for k in r if k.startswith("profile/")) for r in records] == [
        [], [], ["profile/gpu_busy_s", "profile/gpu_idle_between_kernels_s", "profile/wall_s"], []]
    assert "GPU idle between kernels: no device events" in report  # on the CPU
    assert records[2]["profile/wall_s"] == records[2]["step_time_s"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=-1", "config error: train.lr=-1: expected a number >= 0.0"),
        ("train.no_such_key=1", "Key 'no_such_key' is not in struct"),
        ("model=5B", "Could not find 'model/5B'"),
        ("data=packed", "config error: Missing mandatory value: data.path"),
    ],
)
def test_bad_override_fails_at_start_naming_the_key(workdir, override, message):
    result = subprocess.run(
        [sys.executable, PRETRAIN, override], cwd=REPO, env=pretrain_env(workdir), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert message in result.stderr


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("pretrain", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=0", "train.steps=0"),
        ("train.steps=ten", "train.steps='ten'"),
        ("train.seq_len=9000", "train.seq_len=9000"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio=2"),
        ("train.precision=fp8", "train.precision='fp8'"),
        ("train.betas=[0.9]", "train.betas="),
        ("train.resume=/nonexistent/run", "train.resume='/nonexistent/run'"),
        ("train.resume=auto", "train.resume='auto' needs run_dir"),
        ("model.gdn_backend=triton", "model.gdn_backend='triton'"),
        ("model.init_from=/nonexistent", "model.init_from='/nonexistent'"),
        ("data.path=/nonexistent", "data.path='/nonexistent'"),
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage=4"),
        ("deepspeed=zero2_offload", None),
        ("deepspeed.offload_param=true", "deepspeed.offload_param=true"),
        ("logger.mode=online-ish", "logger.mode='online-ish'"),
        ("parallel.tp=0", "parallel.tp=0: expected an integer >= 1"),
        ("parallel.sequence_parallel=yes", "parallel.sequence_parallel='yes'"),
        ("parallel.tp=2", None),
        ("benchmark.compare_backends=[tilelang]", "benchmark.compare_backends=['tilelang']"),
        ("benchmark.compare_backends=[tilelang,cuda]", "benchmark.compare_backends[1]='cuda'"),
        ("benchmark.profile_step=-1", "benchmark.profile_step=-1: expected an integer >= 0"),
    ],
)
def test_config_validation_names_the_key(override, key):
    cfg = _compose(override)
    if key is None:
        validate_config(cfg)
        return
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert str(error.value).startswith(key)


def test_sequence_parallel_needs_tokens_divisible_by_tp():
    cfg = _compose("parallel.tp=4", "parallel.sequence_parallel=true", "train.tokens_per_micro_batch=8190",
                   "train.seq_len=4096")
    with pytest.raises(ConfigError, match=r"^parallel.sequence_parallel=true: train.tokens_per_micro_batch=8190"):
        validate_config(cfg)
    validate_config(_compose("parallel.tp=4", "parallel.sequence_parallel=true"))  # 8192 tokens split


def test_every_experiment_preset_composes_and_validates():
    for preset in sorted((REPO / "configs" / "experiment").glob("*.yaml")):
        cfg = _compose(f"experiment={preset.stem}")
        validate_config(cfg)


def test_deepspeed_config_follows_the_groups():
    config = deepspeed_config(_compose("deepspeed=zero3_offload", "train.gradient_accumulation=4"), on_cuda=True,
                              data_parallel_size=1)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["optimizer"]["type"] == "AdamW" and config["gradient_accumulation_steps"] == 4
    assert config["bf16"]["enabled"] is True
    merged = deepspeed_config(_compose("+deepspeed.overrides.zero_optimization.reduce_bucket_size=1000"), on_cuda=True,
                              data_parallel_size=2)
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                           "reduce_bucket_size": 1000}
    assert "optimizer" not in merged
    assert merged["timers"] == {"throughput": {"enabled": False}}  # it synchronises the device twice a step


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_one_data_parallel_rank_runs_zero_without_gradient_hooks(stage):
    one_rank = deepspeed_config(_compose(f"deepspeed={stage}"), on_cuda=True, data_parallel_size=1)
    assert one_rank["zero_optimization"] == {"stage": 1, "overlap_comm": False, "contiguous_gradients": False}
    # where the hooks do a job: reducing over ranks, accumulating micro-batches, the offloaded optimizer
    for overrides, ranks in (((), 2), (("train.gradient_accumulation=2",), 1), (("deepspeed=zero2_offload",), 1)):
        config = deepspeed_config(_compose(f"deepspeed={stage}", *overrides), on_cuda=True, data_parallel_size=ranks)
        assert config["zero_optimization"]["contiguous_gradients"] is True, (overrides, ranks)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    values = [lr_multiplier(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    assert lr_multiplier(0, warmup_steps=0, total_steps=1, min_lr_ratio=0.0) == 1.0


def test_resume_point_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="train.resume=.*no checkpoint there"):
        find_resume_point(str(tmp_path), None)
    assert find_resume_point("auto", str(tmp_path)) is None


def test_profile_summary_counts_each_kernel_once():
    """The profiler attributes a kernel's device time to the CPU op that launched it as well: only
    the CUDA events count as GPU time, or a step would look more than 100 % busy."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from train.metrics import profile_summary

    def event(key, device_type, device_us, cpu_us):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us,
                               self_cpu_time_total=cpu_us, count=1)

    events = [event("aten::mm", DeviceType.CPU, 900, 50), event("gemm_kernel", DeviceType.CUDA, 900, 0),
              event("aten::copy_", DeviceType.CPU, 0, 400)]
    report, record = profile_summary(SimpleNamespace(key_averages=lambda: events), wall_s=0.002)
    assert record == {"profile/gpu_busy_s": 0.0009, "profile/wall_s": 0.002}
    assert report.startswith("wall 0.0020 s, GPU kernels 0.0009 s (45 % of the wall time)")
    kernels_section = report.split("host ops")[0]
    assert "gemm_kernel" in kernels_section and "aten::mm" not in kernels_section


def test_gpu_idle_gaps_name_the_kernel_after_each_wait_and_its_launcher():
    """Busy intervals of two streams merge; only gaps of at least min_gap_us count; the largest gap
    comes first, with the kernel that ended it and the host op (and caller) that launched it."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from train.metrics import gpu_idle_gaps

    def op(name, start, launched=(), parent=None):
        """A host op as torch's profiler gives it: the kernels it launched by name, no device time."""
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent,
                               kernels=[SimpleNamespace(name=k) for k in launched],
                               time_range=SimpleNamespace(start=start, end=start + 5))

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, cpu_parent=None, kernels=[],
                               time_range=SimpleNamespace(start=start, end=end))

    layer = op("QwenHybridForCausalLM", -10)
    events = [layer, op("aten::mm", -5, ["gemm", "late_gemm"]),  # an earlier launch of late_gemm: not it
              op("aten::add", -4, ["overlapping", "add_kernel", "norm"]),
              op("aten::mm", 460, ["late_gemm"], op("MmBackward0", 455, parent=layer)),
              op("aten::mul", 475, ["late_gemm"]),     # launched the same kernel after it started: not it
              kernel("gemm", 0, 100), kernel("overlapping", 50, 150),  # a second stream: no gap
              kernel("add_kernel", 160, 170),                          # 10 us: below the threshold
              kernel("late_gemm", 470, 500), kernel("norm", 600, 610)]
    lines, idle_s = gpu_idle_gaps(events, min_gap_us=20)
    assert idle_s == (300 + 100) / 1e6
    assert lines[0].startswith("GPU idle between kernels: 0.40 ms in 2 gaps of >= 20 us, over 0.61 ms")
    assert lines[1] == "     0.300 ms before late_gemm (launched by aten::mm < MmBackward0 < QwenHybridForCausalLM)"
    assert lines[2] == "     0.100 ms before norm (launched by aten::add)"
    assert gpu_idle_gaps([layer], min_gap_us=20) == (["GPU idle between kernels: no device events"], 0.0)
    # torch's own host events carry what the lookup reads (a fake kernel stands in for the device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    host = list(prof.events())
    assert gpu_idle_gaps(host + [kernel("gemm", 0, 1), kernel("gemm", 50, 60)], min_gap_us=20)[1] == 49e-6


def test_auto_attention_keeps_as_many_layers_as_the_memory_holds():
    from train.pretrain import attention_layers_to_keep

    gib = 2**30
    # 0.8B at 524288 tokens on an H200 (139.8 GiB): 89.6 GiB reserved recomputing, <= 12 GiB a kept layer
    assert attention_layers_to_keep(89.6 * gib, 139.8 * gib, 12 * gib, 6) == 3
    assert attention_layers_to_keep(40 * gib, 139.8 * gib, 3 * gib, 6) == 6      # all fit: capped at the layers
    assert attention_layers_to_keep(80 * gib, 80 * gib, 3 * gib, 6) == 0         # already past the fraction
    assert attention_layers_to_keep(10 * gib, 80 * gib, 3 * gib, 0) == 0
    assert attention_layers_to_keep(10 * gib, 80 * gib, 3 * gib, 6, fraction=0.5) == 6
    assert attention_layers_to_keep(10 * gib, 80 * gib, 10 * gib, 6, fraction=0.5) == 3


def test_auto_attention_decision_switches_the_model(monkeypatch):
    """keep_attention_by_memory on a CUDA device (its memory faked): the tiny model's two checkpointed
    attention layers, one of which fits; with context parallelism both keep recomputing."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
    from train.pretrain import ATTENTION_KEEP_MEMORY_FRACTION, keep_attention_by_memory

    model = QwenHybridForCausalLM(QwenHybridConfig.named("tiny", gdn_backend="torch"))
    model.set_activation_checkpointing(True)
    tokens = 4096
    per_layer = model.kept_attention_bytes(tokens)
    total = 100 * per_layer
    peak = ATTENTION_KEEP_MEMORY_FRACTION * total - 1.5 * per_layer  # room for one layer, not two
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - peak, total))

    def run(cp):
        cfg = OmegaConf.create({"parallel": {"cp": cp}, "train": {"tokens_per_micro_batch": tokens}})
        return SimpleNamespace(engine=SimpleNamespace(module=model), device=torch.device("cuda", 0), cfg=cfg,
                               state=SimpleNamespace(step=2), world_size=1)

    def kept():
        return [a.checkpoint_around_attention for a in model.checkpointed_attention()]

    keep_attention_by_memory(run(cp=2), SimpleNamespace(peak_reserved_gib=peak / 2**30))
    assert kept() == [False, False]
    keep_attention_by_memory(run(cp=1), SimpleNamespace(peak_reserved_gib=peak / 2**30))
    assert kept() == [True, False]


def test_auto_attention_keeps_more_layers_by_what_the_kept_ones_cost(monkeypatch):
    """After the first step with kept layers, their measured cost (the rise of the peak reserved memory)
    replaces the estimate where it lets more layers keep theirs: 0.8B at 524288 tokens on the H200 as
    measured (89.6 GiB reserved recomputing, 110.6 with two of six kept against 15.0 GiB a layer
    estimated) keeps three. Never fewer, and a rise hidden in already-reserved blocks (none at all) is
    taken as half the estimate."""
    from types import SimpleNamespace

    from train.pretrain import AttentionKeep, keep_more_attention_by_measure

    gib = 2**30
    calls = []
    model = SimpleNamespace(keep_attention_tensors=calls.append)
    run = SimpleNamespace(engine=SimpleNamespace(module=model), state=SimpleNamespace(step=3))
    decision = AttentionKeep(peak_reserved=89.6 * gib, total=139.8 * gib, per_layer=15.0 * gib, layers=6, kept=2)

    keep_more_attention_by_measure(run, SimpleNamespace(peak_reserved_gib=110.6), decision)
    assert calls == [3]
    calls.clear()
    keep_more_attention_by_measure(run, SimpleNamespace(peak_reserved_gib=89.6 + 2 * 16.0), decision)
    assert calls == []  # costlier than estimated: keeps what it kept
    keep_more_attention_by_measure(run, SimpleNamespace(peak_reserved_gib=89.6), decision)
    assert calls == [4]  # no rise: 7.5 GiB a layer, (125.8 - 89.6) // 7.5 = 4
    calls.clear()
    for kept in (0, 6):  # nothing or everything kept: nothing to measure or to add
        keep_more_attention_by_measure(run, SimpleNamespace(peak_reserved_gib=100.0),
                                       AttentionKeep(89.6 * gib, 139.8 * gib, 15.0 * gib, 6, kept))
    keep_more_attention_by_measure(run, SimpleNamespace(peak_reserved_gib=100.0), None)
    assert calls == []


def test_out_of_memory_with_kept_attention_names_the_setting():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
    from train.pretrain import out_of_memory_hint

    model = QwenHybridForCausalLM(QwenHybridConfig.named("tiny", gdn_backend="torch"))
    model.set_activation_checkpointing(True)

    def run(recompute_attention):
        cfg = OmegaConf.create({"train": {"activation_checkpointing": True, "recompute_attention": recompute_attention}})
        return SimpleNamespace(engine=SimpleNamespace(module=model), cfg=cfg, state=SimpleNamespace(step=4))

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert out_of_memory_hint(run("auto"), oom) is None  # every attention layer recomputes: not the cause
    model.keep_attention_tensors(1)
    assert out_of_memory_hint(run("auto"), oom).startswith(
        "out of memory at step 5 while auto kept the attention kernel's tensors in 1 layer(s): rerun with "
        "train.recompute_attention=true")
    assert "train.recompute_attention=false keeps" in out_of_memory_hint(run(False), oom)
    assert out_of_memory_hint(run("auto"), RuntimeError("another error")) is None
