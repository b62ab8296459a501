"""Per-step metrics: `metrics.jsonl` in the run directory and W&B (written by rank 0; loss and peak
memory gathered from every rank), and the benchmark-only instruments of a step (`StepInstruments`):
per-kernel times from module hooks (rank 0's), one-step profile summaries, and the step-by-step
backend comparison."""
from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qwen_hybrid.layers import AttentionCore, GatedDeltaRule

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"
# The modules timed, by the name their times are logged under.
TIMED_MODULES = {"gdn": GatedDeltaRule, "attention": AttentionCore}
KERNEL_TIME_KEYS = tuple(f"time/{group}_{phase}_s" for group in TIMED_MODULES for phase in ("fwd", "bwd", "recompute"))


class KernelTimer:
    """Times every GatedDeltaRule and AttentionCore call with forward/backward hooks.

    CUDA events on GPU (read after the step's synchronize), perf_counter on CPU. Forwards that
    run while `phase == "bwd"` are activation-checkpoint recomputation and are logged apart.
    The hooks cost a little (full backward hooks add autograd nodes), so timing is switchable.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.use_cuda_events = device.type == "cuda"
        self.phase = "fwd"
        self._starts: dict[tuple[int, str], object] = {}
        self._spans: list[tuple[str, object, object]] = []
        self._handles = []
        for module in model.modules():
            group = next((name for name, cls in TIMED_MODULES.items() if isinstance(module, cls)), None)
            if group is None:
                continue
            self._handles += [
                module.register_forward_pre_hook(self._start_hook("fwd")),
                module.register_forward_hook(self._end_hook(group, "fwd")),
                module.register_full_backward_pre_hook(self._start_hook("bwd")),
                module.register_full_backward_hook(self._end_hook(group, "bwd")),
            ]
        if not self._handles:
            raise ValueError("KernelTimer found no GatedDeltaRule or AttentionCore module in the model")

    def _mark(self):
        if self.use_cuda_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start_hook(self, direction: str):
        def hook(module, *_):
            self._starts[(id(module), direction)] = self._mark()

        return hook

    def _end_hook(self, group: str, direction: str):
        def hook(module, *_):
            start = self._starts.pop((id(module), direction), None)
            if start is None:
                return
            phase = "recompute" if direction == "fwd" and self.phase == "bwd" else direction
            self._spans.append((f"time/{group}_{phase}_s", start, self._mark()))

        return hook

    def collect(self) -> dict[str, float]:
        """Seconds per kernel bucket since the last collect; call after the device is synchronized."""
        totals = dict.fromkeys(KERNEL_TIME_KEYS, 0.0)
        for key, start, end in self._spans:
            totals[key] += start.elapsed_time(end) / 1000.0 if self.use_cuda_events else end - start
        self._spans.clear()
        self._starts.clear()
        return totals

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def profile_summary(prof, wall_s: float, count: int = 30) -> tuple[str, dict]:
    """What one profiled step spent its time on: the costliest GPU kernels and host ops, and how
    busy the GPU was. A GPU busy for much less than the wall time means the step waits on the host
    (launch overhead, syncs, data), not on kernels. Returns (text report, metrics to log)."""
    from torch.autograd import DeviceType

    events = list(prof.key_averages())
    # GPU kernels only: the CPU ops that launched them carry the same device time
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0),
                     key=lambda e: e.self_device_time_total, reverse=True)
    host_ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    gpu_busy_s = sum(e.self_device_time_total for e in kernels) / 1e6
    lines = [f"wall {wall_s:.4f} s, GPU kernels {gpu_busy_s:.4f} s ({100 * gpu_busy_s / wall_s:.0f} % of the wall time)",
             "", f"GPU kernels by self time (top {count}):"]
    lines += [f"  {e.self_device_time_total / 1e3:10.2f} ms {e.count:7d} calls  {e.key[:110]}" for e in kernels[:count]]
    lines += ["", f"host ops by self CPU time (top {count}):"]
    lines += [f"  {e.self_cpu_time_total / 1e3:10.2f} ms {e.count:7d} calls  {e.key[:110]}" for e in host_ops[:count]]
    record = {"profile/gpu_busy_s": gpu_busy_s, "profile/wall_s": wall_s}
    events_in_order = getattr(prof, "events", None)
    if events_in_order is not None:
        gap_lines, idle_s = gpu_idle_gaps(list(events_in_order()))
        lines += ["", *gap_lines]
        record["profile/gpu_idle_between_kernels_s"] = idle_s
    return "\n".join(lines) + "\n", record


def gpu_idle_gaps(events, min_gap_us: float = 20.0, count: int = 15) -> tuple[list[str], float]:
    """Where the GPU waited between its first and last kernel: the device events' busy intervals
    (all streams merged), the gaps of at least min_gap_us between them, and for the largest gaps the
    kernel that ended the wait and the host op that launched it, with that op's callers. A gap is
    time the host took to launch the next kernel. Returns (report lines, idle seconds between kernels).

    The launcher is the latest host op that started before the kernel and lists a kernel of that
    name (FunctionEvent.kernels, filled in every torch release; the exact link,
    FunctionEvent.linked_correlation_id, is not there before torch 2.13). After a gap the GPU was
    waiting for that kernel, so it was launched just before it started: the latest such op is it."""
    import bisect

    from torch.autograd import DeviceType

    device = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not device:
        return ["GPU idle between kernels: no device events"], 0.0
    launches: dict[str, list] = {}  # kernel name -> [(start, host op)] in start order
    for op in sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start):
        for name in {k.name for k in op.kernels}:
            launches.setdefault(name, []).append((op.time_range.start, op))

    def launcher(kernel):
        candidates = launches.get(kernel.name, [])
        index = bisect.bisect_right(candidates, kernel.time_range.start, key=lambda c: c[0])
        return candidates[index - 1][1] if index else None

    gaps, busy_until = [], device[0].time_range.end
    for event in device[1:]:
        if event.time_range.start - busy_until >= min_gap_us:
            gaps.append((event.time_range.start - busy_until, event))
        busy_until = max(busy_until, event.time_range.end)
    idle_us = sum(gap for gap, _ in gaps)
    span_us = busy_until - device[0].time_range.start
    lines = [f"GPU idle between kernels: {idle_us / 1e3:.2f} ms in {len(gaps)} gaps of >= {min_gap_us:.0f} us, "
             f"over {span_us / 1e3:.2f} ms from the first kernel to the last; largest {count}:"]
    for gap, event in sorted(gaps, key=lambda g: g[0], reverse=True)[:count]:
        callers, op = [], launcher(event)
        while op is not None and len(callers) < 3:
            callers.append(op.name[:50])
            op = op.cpu_parent
        launched_by = " < ".join(callers) if callers else "?"
        lines.append(f"  {gap / 1e3:8.3f} ms before {event.name[:60]} (launched by {launched_by})")
    return lines, idle_us / 1e6


# Dense bf16 tensor-core peak per GPU (the vendor's figure), for model FLOPs utilisation.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0}


def matmul_parameters(num_parameters: int, config) -> int:
    """Parameters that take part in a matmul per token: all but the embedding table, whose lookup
    is free; the LM head's V x H matmul counts once whether or not it shares the table."""
    embedding = config.vocab_size * config.hidden_size
    return num_parameters - embedding + (embedding if config.tie_word_embeddings else 0)


def training_flops(matmul_params: int, config, document_lengths: list[int]) -> float:
    """FLOPs of one forward + backward over a packed sequence (docs/performance.md, "Model FLOPs"):
    6 N T for the parameter matmuls, plus causal attention's QK^T and PV per attention layer,
    2 H d L^2 forward per document of length L (half of the full square), three times that with
    the backward. The GDN op's own chunk products (about 1 % of 6 N T at 0.8B) are not counted,
    nor activation-checkpoint recomputation (model FLOPs, not hardware FLOPs)."""
    tokens = sum(document_lengths)
    attention_layers = sum(t == "full_attention" for t in config.layer_types)
    attention = 6 * config.num_attention_heads * config.head_dim * sum(length * length for length in document_lengths)
    return 6.0 * matmul_params * tokens + attention_layers * attention


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak per GPU for MFU: benchmark.peak_tflops when set, else the table by device name; None
    on the CPU or an unknown GPU (then no MFU is logged)."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name.split()), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class BackendComparison:
    """Alternates GDN backends step by step and compares the steps of each full cycle.

    Step s (1-based) runs backends[(s - 1) % len(backends)]; once a cycle completes, each backend's
    step time and kernel times are divided by the first backend's (so >1 means slower than it).
    """

    def __init__(self, backends: list[str], warmup_steps: int):
        self.backends = list(backends)
        self.warmup_steps = warmup_steps
        self._cycle: dict[str, dict[str, float]] = {}
        self.history: dict[str, list[dict[str, float]]] = {name: [] for name in self.backends}

    def backend_for_step(self, step: int) -> str:
        return self.backends[(step - 1) % len(self.backends)]

    def record(self, step: int, times: dict[str, float], timed: bool = True) -> dict[str, float]:
        """Store this step's times; returns the ratio metrics when `step` closes a cycle. A step
        that is not `timed` (run under the profiler) leaves its whole cycle out."""
        backend = self.backend_for_step(step)
        self._cycle[backend] = times if timed else None
        if step > self.warmup_steps and timed:
            self.history[backend].append(times)
        if backend != self.backends[-1] or len(self._cycle) != len(self.backends):
            return {}
        cycle, self._cycle = self._cycle, {}
        if any(times is None for times in cycle.values()):
            return {}
        return self._ratios(cycle, prefix="compare")

    def _ratios(self, times_by_backend: dict[str, dict[str, float]], prefix: str) -> dict[str, float]:
        base_name = self.backends[0]
        base = times_by_backend[base_name]
        ratios = {}
        for name in self.backends[1:]:
            for key, value in times_by_backend[name].items():
                if base.get(key, 0.0) > 0.0:
                    metric = key.removeprefix("time/").removesuffix("_s")
                    ratios[f"{prefix}/{name}_over_{base_name}/{metric}"] = value / base[key]
        return ratios

    def summary(self) -> tuple[list[str], list[list]]:
        """Median seconds per backend after warmup and each backend's ratio to the first:
        (columns, rows) for a table, one row per timed quantity."""
        if any(not runs for runs in self.history.values()):
            return [], []
        keys = list(self.history[self.backends[0]][0])
        medians = {
            name: {key: statistics.median(run[key] for run in runs) for key in keys}
            for name, runs in self.history.items()
        }
        columns = ["quantity"] + [f"{name}_s" for name in self.backends]
        columns += [f"{name}_over_{self.backends[0]}" for name in self.backends[1:]]
        rows = []
        for key in keys:
            row = [key.removeprefix("time/").removesuffix("_s")] + [medians[name][key] for name in self.backends]
            base = medians[self.backends[0]][key]
            row += [medians[name][key] / base if base > 0 else None for name in self.backends[1:]]
            rows.append(row)
        return columns, rows


@dataclass
class StepTiming:
    seconds: float = 0.0
    profile: dict | None = None


class StepInstruments:
    """What `benchmark.*` adds to a step, kept out of the training loop: the GDN backend of this
    step when alternating (`compare_backends`), kernel timing hooks, and the profiler on
    `profile_step`. With all of them off it only times the step."""

    def __init__(self, bench_cfg, model: nn.Module, device: torch.device, run_dir: Path, rank: int):
        self.device, self.run_dir, self.rank = device, run_dir, rank
        self.profile_step = bench_cfg.profile_step
        self.comparison = None
        if bench_cfg.compare_backends:
            self.comparison = BackendComparison(list(bench_cfg.compare_backends), bench_cfg.warmup_steps)
        self.timer = KernelTimer(model, device) if bench_cfg.kernel_timing or self.comparison else None
        self.model = model

    def phase(self, name: str) -> None:
        """'fwd' or 'bwd': forwards run during 'bwd' are checkpoint recomputation."""
        if self.timer is not None:
            self.timer.phase = name

    @contextmanager
    def step(self, step: int):
        """Times the step (device synchronized at both ends); yields its StepTiming."""
        if self.comparison is not None:
            self.model.set_gdn_backend(self.comparison.backend_for_step(step))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        timing = StepTiming()
        profiled = step == self.profile_step and self.rank == 0
        with _profiler(self.device) if profiled else nullcontext() as profiler:
            _synchronize(self.device)
            start = time.perf_counter()
            yield timing
            _synchronize(self.device)
            timing.seconds = time.perf_counter() - start
        if profiler is not None:
            report, timing.profile = profile_summary(profiler, timing.seconds)
            path = self.run_dir / f"profile-step{step}.txt"
            path.write_text(report)
            logging.getLogger("train").info(f"profile of this step written to {path}")

    def record(self, step: int, timing: StepTiming) -> dict:
        """This step's benchmark metrics: profile, kernel times and the rest, backend ratios."""
        record = dict(timing.profile or {})
        if self.timer is not None:
            kernel_times = self.timer.collect()
            record.update(kernel_times)
            record["time/rest_s"] = timing.seconds - sum(kernel_times.values())
        if self.comparison is not None:
            record["gdn_backend"] = self.comparison.backend_for_step(step)
            times = {"step_time_s": timing.seconds, **{k: v for k, v in record.items() if k.startswith("time/")}}
            record.update(self.comparison.record(step, times, timed=timing.profile is None))
        return record

    def log_comparison(self, metrics: "MetricsLog", step: int) -> None:
        if self.comparison is not None:
            metrics.log_comparison(self.comparison, step)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.remove()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profiler(device: torch.device):
    """torch.profiler over one step: host ops, and GPU kernels on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line that does not parse (a run killed mid-write leaves its
    last line torn) is dropped with a warning naming it."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logging.getLogger("train").warning(f"{path}: line {number} is not JSON (torn by a crash?), dropped: {line[:80]!r}")
    return records


class MetricsLog:
    """One JSON object per step in run_dir/metrics.jsonl, mirrored to W&B. Only rank 0 makes one.

    `resumed_step`: the step training continues from; the lines of later steps (logged by the run
    that died, and redone now) are dropped, as is a torn last line."""

    def __init__(self, run_dir: Path, logger_cfg: dict, run_config: dict, resumed_step: int | None):
        self.path = run_dir / METRICS_FILE
        if resumed_step is not None and self.path.exists():
            kept = [r for r in read_records(self.path) if r.get("step", 0) <= resumed_step]
            partial = self.path.with_name(self.path.name + ".tmp")
            partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(partial, self.path)
        self._file = open(self.path, "a")
        self.wandb_run = None
        if logger_cfg["mode"] != "disabled":
            self.wandb_run = _start_wandb(run_dir, logger_cfg, run_config)

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def log_comparison(self, comparison: BackendComparison, step: int) -> None:
        columns, rows = comparison.summary()
        if not rows:
            return
        self._file.write(json.dumps({"step": step, "comparison_summary": {"columns": columns, "rows": rows}}) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=columns, data=rows)
            ratio_column = columns[-1]
            self.wandb_run.log(
                {
                    "compare/summary": table,
                    "compare/summary_ratio": wandb.plot.bar(
                        table, "quantity", ratio_column, title=f"median {ratio_column} per quantity"
                    ),
                },
                step=step,
            )

    def log_run_summary(self, records: list[dict], warmup_steps: int) -> None:
        """Medians over this process's steps after the first `warmup_steps` (compilation, allocator
        warmup) and not profiled, peak memory over all of them (and over each backend's steps when they
        alternate): one line in metrics.jsonl and on the console."""
        timed = [r for r in records[warmup_steps:] if "profile/wall_s" not in r] or records
        if not timed:
            return
        summary = {
            "first_loss": records[0]["loss"],
            "last_loss": records[-1]["loss"],
            "timed_steps": len(timed),
            "median_step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "peak_memory_gib": max(r["peak_memory_gib"] for r in records),
        }
        if "peak_memory_reserved_gib" in records[0]:
            summary["peak_memory_reserved_gib"] = max(r["peak_memory_reserved_gib"] for r in records)
        # alternating backends: each one's peak over its own steps (CUDA's peak is reset every step)
        backends = list(dict.fromkeys(r["gdn_backend"] for r in records if "gdn_backend" in r))
        if len(backends) > 1:
            for backend in backends:
                summary[f"peak_memory_gib/{backend}"] = max(r["peak_memory_gib"] for r in records
                                                            if r.get("gdn_backend") == backend)
        for key in KERNEL_TIME_KEYS + ("time/rest_s",):
            if key in timed[0]:
                summary["median_" + key.removeprefix("time/")] = statistics.median(r[key] for r in timed)
        self._file.write(json.dumps({"step": records[-1]["step"], "run_summary": summary}) + "\n")
        self._file.flush()
        print("run summary: " + ", ".join(f"{k}={v:.4g}" for k, v in summary.items()), flush=True)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb(run_dir: Path, logger_cfg: dict, run_config: dict):
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=logger_cfg["project"],
        entity=logger_cfg["entity"],
        name=logger_cfg["name"] or run_dir.name,
        tags=list(logger_cfg["tags"]),
        mode=logger_cfg["mode"],
        dir=str(run_dir),
        id=run_id,
        resume="allow",
        config=run_config,
        settings=wandb.Settings(console="off", silent=True),
    )
