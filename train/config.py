"""Checks of the composed Hydra config (every bad value fails at start, naming its key) and the
DeepSpeed config derived from it."""
from __future__ import annotations

from numbers import Real
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from flashqla.api import is_keep_for_backward
from qwen_hybrid.attention import ATTENTION_BACKENDS, fa4_unavailable_reason
from qwen_hybrid.config import CONV_BACKENDS, GDN_BACKENDS, GDN_KEEP_FOR_BACKWARD, NAMED_SIZES

PRECISIONS = ("bf16", "fp32")
LOGGER_MODES = ("online", "offline", "disabled")
ZERO_STAGES = (0, 1, 2, 3)


class ConfigError(ValueError):
    """A config value that cannot run; the message starts with the key."""


def _integer(key: str, value, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        expected = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def _number(key: str, value, minimum: float | None = None, maximum: float | None = None) -> None:
    ok = isinstance(value, Real) and not isinstance(value, bool)
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        bounds = " ".join(
            part for part in (f">= {minimum}" if minimum is not None else "", f"<= {maximum}" if maximum is not None else "")
            if part
        )
        raise ConfigError(f"{key}={value!r}: expected a number {bounds}".rstrip())


def _boolean(key: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")


def _choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: expected one of {list(choices)}")


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value that cannot run."""
    model, train, ds = cfg.model, cfg.train, cfg.deepspeed

    _choice("model.name", model.name, NAMED_SIZES)
    _choice("model.gdn_backend", model.gdn_backend, GDN_BACKENDS)
    _choice("model.conv_backend", model.conv_backend, CONV_BACKENDS)
    _choice("model.attention_backend", model.attention_backend, ATTENTION_BACKENDS)
    if not is_keep_for_backward(model.gdn_keep_for_backward):
        raise ConfigError(f"model.gdn_keep_for_backward={model.gdn_keep_for_backward!r}: expected one of "
                          f"{list(GDN_KEEP_FOR_BACKWARD)} (true, inverse or false)")
    if model.vocab_size is not None:
        _integer("model.vocab_size", model.vocab_size, 1)
    if model.init_from is not None and not (Path(str(model.init_from)) / "config.json").is_file():
        raise ConfigError(f"model.init_from={model.init_from!r}: expected an HF checkpoint directory with config.json")

    if cfg.data.path is None:
        _integer("data.embedded_documents", cfg.data.embedded_documents, 1)
    elif not Path(str(cfg.data.path)).is_dir():
        raise ConfigError(f"data.path={cfg.data.path!r}: expected a dataset directory from train.prepare_data")

    _boolean("data.document_boundaries", cfg.data.document_boundaries)

    _integer("train.steps", train.steps, 1)
    _integer("train.tokens_per_micro_batch", train.tokens_per_micro_batch, 2)
    _integer("train.seq_len", train.seq_len, 1)
    if train.seq_len > train.tokens_per_micro_batch:
        raise ConfigError(
            f"train.seq_len={train.seq_len}: expected <= train.tokens_per_micro_batch={train.tokens_per_micro_batch} "
            "(a document piece cannot be longer than the micro-batch it is packed in)"
        )
    _integer("train.gradient_accumulation", train.gradient_accumulation, 1)
    _number("train.lr", train.lr, 0.0)
    _number("train.min_lr_ratio", train.min_lr_ratio, 0.0, 1.0)
    _integer("train.warmup_steps", train.warmup_steps, 0)
    if train.warmup_steps > train.steps:
        raise ConfigError(
            f"train.warmup_steps={train.warmup_steps}: expected <= train.steps={train.steps} (the schedule would "
            "never reach the peak lr)"
        )
    _number("train.weight_decay", train.weight_decay, 0.0)
    if not isinstance(train.betas, ListConfig) or len(train.betas) != 2:
        raise ConfigError(f"train.betas={train.betas!r}: expected a list of two numbers in [0, 1)")
    for i, beta in enumerate(train.betas):
        _number(f"train.betas[{i}]", beta, 0.0, 0.999999)
    if train.grad_clip is not None:
        _number("train.grad_clip", train.grad_clip, 0.0)
    _integer("train.seed", train.seed, 0)
    _choice("train.precision", train.precision, PRECISIONS)
    _boolean("train.activation_checkpointing", train.activation_checkpointing)
    if not (isinstance(train.recompute_attention, bool) or train.recompute_attention == "auto"):
        raise ConfigError(f"train.recompute_attention={train.recompute_attention!r}: expected true, false or auto")
    if train.checkpoint_layers is not None:
        _integer("train.checkpoint_layers", train.checkpoint_layers, 0)
        if not train.activation_checkpointing:
            raise ConfigError(f"train.checkpoint_layers={train.checkpoint_layers}: expected "
                              "train.activation_checkpointing=true (it says how many layers that recomputes)")
    _integer("train.loss_chunk_size", train.loss_chunk_size, 1)
    _integer("train.checkpoint_every", train.checkpoint_every, 0)
    _integer("train.keep_checkpoints", train.keep_checkpoints, 1)
    _boolean("train.checkpoint_at_exit", train.checkpoint_at_exit)
    if train.stop_at_step is not None:
        _integer("train.stop_at_step", train.stop_at_step, 1)
    _boolean("train.export_hf", train.export_hf)
    _integer("train.max_bad_steps", train.max_bad_steps, 1)
    _boolean("train.overwrite", train.overwrite)
    if train.overwrite and train.resume is not None:
        raise ConfigError(f"train.overwrite=true: expected train.resume=null (got {train.resume!r}); overwriting "
                          "deletes the run that resuming would continue")
    if train.resume is not None and train.resume != "auto":
        resume_path = Path(str(train.resume))
        if not resume_path.is_dir():
            raise ConfigError(f"train.resume={train.resume!r}: expected 'auto', a run directory or a checkpoint directory")
    if train.resume == "auto" and cfg.run_dir is None:
        raise ConfigError("train.resume='auto' needs run_dir=PATH: it resumes that directory's latest checkpoint if any")

    _choice("deepspeed.zero_stage", ds.zero_stage, ZERO_STAGES)
    _boolean("deepspeed.offload_optimizer", ds.offload_optimizer)
    _boolean("deepspeed.offload_param", ds.offload_param)
    _boolean("deepspeed.one_pass_grad_checks", ds.one_pass_grad_checks)
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer=true: expected deepspeed.zero_stage >= 1")
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError(f"deepspeed.offload_param=true: expected deepspeed.zero_stage=3, got {ds.zero_stage}")
    if not isinstance(ds.overrides, DictConfig):
        raise ConfigError(f"deepspeed.overrides={ds.overrides!r}: expected a mapping of DeepSpeed config keys")
    checkpoint_overrides = ds.overrides.get("checkpoint") or {}
    if checkpoint_overrides.get("use_node_local_storage", False):
        raise ConfigError(
            "deepspeed.overrides.checkpoint.use_node_local_storage=true: expected false (rank 0 verifies and renames "
            "every rank's checkpoint files, so all ranks write into the shared run directory)"
        )

    _choice("logger.mode", cfg.logger.mode, LOGGER_MODES)

    _integer("parallel.tp", cfg.parallel.tp, 1)
    _integer("parallel.cp", cfg.parallel.cp, 1)
    _boolean("parallel.sequence_parallel", cfg.parallel.sequence_parallel)
    if train.tokens_per_micro_batch % cfg.parallel.cp != 0:
        raise ConfigError(
            f"parallel.cp={cfg.parallel.cp}: train.tokens_per_micro_batch={train.tokens_per_micro_batch} must divide by "
            "it (each rank of a context-parallel group holds an equal slice of the packed sequence)"
        )
    shares = cfg.parallel.tp * cfg.parallel.cp
    if cfg.parallel.sequence_parallel and train.tokens_per_micro_batch % shares != 0:
        raise ConfigError(
            f"parallel.sequence_parallel=true: train.tokens_per_micro_batch={train.tokens_per_micro_batch} must divide "
            f"by parallel.tp x parallel.cp = {shares} (each rank keeps an equal share of the tokens between blocks)"
        )

    bench = cfg.benchmark
    _boolean("benchmark.kernel_timing", bench.kernel_timing)
    _integer("benchmark.warmup_steps", bench.warmup_steps, 0)
    _integer("benchmark.profile_step", bench.profile_step, 0)
    if bench.peak_tflops is not None:
        _number("benchmark.peak_tflops", bench.peak_tflops, 1e-6)
    if not isinstance(bench.compare_backends, ListConfig):
        raise ConfigError(f"benchmark.compare_backends={bench.compare_backends!r}: expected a list such as [tilelang,fla]")
    if bench.compare_backends:
        if len(bench.compare_backends) < 2 or len(set(bench.compare_backends)) != len(bench.compare_backends):
            raise ConfigError(
                f"benchmark.compare_backends={list(bench.compare_backends)}: expected two or more different backends"
            )
        for i, backend in enumerate(bench.compare_backends):
            _choice(f"benchmark.compare_backends[{i}]", backend, GDN_BACKENDS)


def gdn_backends(cfg: DictConfig) -> list[tuple[str, str]]:
    """(key, backend) of every GDN backend the run will use."""
    named = [("model.gdn_backend", cfg.model.gdn_backend)]
    return named + [(f"benchmark.compare_backends[{i}]", b) for i, b in enumerate(cfg.benchmark.compare_backends)]


def check_environment(cfg: DictConfig) -> None:
    """What this machine must offer for the config: the GDN, conv and attention backends it names."""
    from flashqla.backends import backend_unavailable_reason

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    # (key, backend, the key whose "auto" would pick what runs here)
    named = [(key, backend, "model.gdn_backend") for key, backend in gdn_backends(cfg)]
    named.append(("model.conv_backend", cfg.model.conv_backend, "model.conv_backend"))
    for key, backend, choice in named:
        reason = backend_unavailable_reason(backend, device)
        if reason is not None:
            raise ConfigError(f"{key}={backend!r}: {reason} ({choice}=auto picks what runs here)")
    if cfg.model.attention_backend == "fa4":
        reason = fa4_unavailable_reason(device)
        if reason is not None:
            raise ConfigError(f"model.attention_backend='fa4': {reason} (model.attention_backend=auto picks what runs here)")


def check_parallel_layout(cfg: DictConfig, world_size: int) -> None:
    """What needs the world size, known only once the processes are up."""
    model_parallel = cfg.parallel.tp * cfg.parallel.cp
    if world_size % model_parallel != 0:
        raise ConfigError(
            f"parallel.tp={cfg.parallel.tp}, parallel.cp={cfg.parallel.cp}: expected tp x cp = {model_parallel} to "
            f"divide the world size {world_size} (world = data-parallel x context-parallel x tensor-parallel ranks)"
        )


def without_gradient_hooks(cfg: DictConfig, data_parallel_size: int) -> bool:
    """Whether ZeRO-1/2 runs as ZeRO-1 without per-parameter gradient hooks: on one data-parallel
    rank there is nothing to partition or to reduce while the backward runs, and DeepSpeed's 320
    hooks a step (Python inside the autograd engine, a copy each) only hold the GPU back: 1.32x at
    8192 tokens on one H200 (docs/performance.md). With one micro-batch a step the gradients are the
    same bf16 tensors either way; accumulating several is left to the hooks' path."""
    ds = cfg.deepspeed
    return (data_parallel_size == 1 and ds.zero_stage in (1, 2) and not ds.offload_optimizer
            and cfg.train.gradient_accumulation == 1)


def deepspeed_config(cfg: DictConfig, on_cuda: bool, data_parallel_size: int) -> dict:
    """The DeepSpeed config dict: one packed row per micro-batch; our own optimizer and schedule
    unless the optimizer is offloaded (then DeepSpeed's CPU Adam). data_parallel_size: the ranks
    holding the same parameters, over which ZeRO reduces gradients (dp x cp)."""
    train, ds = cfg.train, cfg.deepspeed
    zero: dict = {"stage": ds.zero_stage}
    if without_gradient_hooks(cfg, data_parallel_size):
        zero.update(stage=1, overlap_comm=False, contiguous_gradients=False)
    elif ds.zero_stage > 0:
        zero.update(overlap_comm=on_cuda, contiguous_gradients=True)
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train.gradient_accumulation,
        "gradient_clipping": float(train.grad_clip or 0.0),
        "bf16": {"enabled": train.precision == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # our own logging replaces DeepSpeed's
        "wall_clock_breakdown": False,
        # its throughput timer synchronises the device twice a step; our metrics time the step
        "timers": {"throughput": {"enabled": False}},
    }
    if ds.offload_optimizer:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": train.lr, "betas": list(train.betas), "weight_decay": train.weight_decay},
        }
    _merge(config, OmegaConf.to_container(ds.overrides, resolve=True))
    return config


def _merge(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
