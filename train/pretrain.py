"""Pretrain or continue pretraining a Qwen3.5-style hybrid model with DeepSpeed.

    deepspeed [--num_gpus N] train/pretrain.py [experiment=NAME] [key=value ...]
    torchrun --nproc_per_node N train/pretrain.py ...
    python train/pretrain.py ...            (one process)

The config groups live in configs/ (see configs/pretrain.yaml). Every rank writes into one run
directory chosen by rank 0: metrics.jsonl, config.yaml, checkpoints/, hf_final/, wandb/.
parallel.tp=N splits every layer's heads over N consecutive ranks (they read the same data);
the world size / N data-parallel replicas share ZeRO's partitions.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from contextlib import closing, nullcontext
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    # run as a script from a checkout: make the repository's packages importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue
from tqdm import tqdm

from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from qwen_hybrid.checkpoint_io import read_config
from qwen_hybrid.layers import GatedDeltaRule
from qwen_hybrid.parallel import (
    ParallelGroups,
    init_parallel_groups,
    load_sharded_hf_checkpoint,
    plan_tensor_parallel,
    shard_model,
)
from train.checkpoint import (
    ResumePoint,
    TrainerState,
    export_hf,
    find_resume_point,
    load_checkpoint,
    save_checkpoint,
)
from train.config import ConfigError, check_parallel_layout, deepspeed_config, validate_config
from train.data import MicroBatchSampler, PackedDataset
from train.metrics import BackendComparison, KernelTimer, MetricsLog, peak_memory_gib, profile_summary
from train.prepare_data import build_embedded_dataset
from train.schedule import warmup_cosine_scheduler

log = logging.getLogger("train")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


class StopRequest:
    """SIGTERM / SIGINT ask the loop to checkpoint and stop after the current step; a second
    SIGINT interrupts at once."""

    def __init__(self):
        self.signal_number: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signal_number, frame):
        if self.signal_number == signal.SIGINT and signal_number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = signal_number


def init_distributed() -> tuple[int, int, int]:
    """Rank, world size, local rank; works under deepspeed, torchrun, srun-wrapped launchers and plain python."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:
        with closing(socket.socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            free_port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port))
    if not torch.cuda.is_available():
        # DeepSpeed would JIT-build its shared-memory allreduce (a minute of compiling) for CPU
        # runs; gloo alone is fine for smoke runs and CI.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(auto_mpi_discovery=False)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def agree_on_run_dir(cfg: DictConfig, resume_point: ResumePoint | None) -> Path:
    """Rank 0 picks the run directory (one timestamp for all), the others receive it."""
    chosen = [None]
    if dist.get_rank() == 0:
        if cfg.run_dir is not None:
            chosen[0] = str(cfg.run_dir)
        elif resume_point is not None:
            chosen[0] = str(resume_point.run_dir)
        else:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
            model_name = Path(str(cfg.model.init_from)).name if cfg.model.init_from else cfg.model.name
            chosen[0] = str(Path(cfg.runs_root) / f"{model_name}-{stamp}")
        Path(chosen[0]).mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def open_dataset(cfg: DictConfig, local_rank: int) -> PackedDataset:
    """data.path, or the embedded corpus built once per node into data.cache_dir."""
    if cfg.data.path is not None:
        return PackedDataset(cfg.data.path)
    path = Path(cfg.data.cache_dir) / f"embedded-docs{cfg.data.embedded_documents}-v1"
    if local_rank == 0 and not path.exists():
        build_embedded_dataset(path, cfg.data.embedded_documents)
    dist.barrier()
    return PackedDataset(path)


def build_model(
    cfg: DictConfig, device: torch.device, dtype: torch.dtype, data_vocab: int, parallel_groups: ParallelGroups
) -> QwenHybridForCausalLM:
    """This rank's model: whole with parallel.tp=1, otherwise its tensor-parallel shard (heads,
    MLP rows and vocabulary split over the tp group), ready for the optimizer and DeepSpeed."""
    overrides = {"gdn_backend": cfg.model.gdn_backend}
    if cfg.model.vocab_size is not None:
        overrides["vocab_size"] = cfg.model.vocab_size
    init_from = cfg.model.init_from
    if init_from is not None:
        config = QwenHybridConfig.from_hf(read_config(init_from), **overrides)
    else:
        config = QwenHybridConfig.named(cfg.model.name, **overrides)
    tp, sequence_parallel = cfg.parallel.tp, cfg.parallel.sequence_parallel
    try:
        plan_tensor_parallel(config, tp, 0, sequence_parallel)  # fail before any weights are read or built
    except ValueError as error:
        raise ConfigError(f"parallel.tp={tp}: model {init_from or cfg.model.name} does not split over {tp} ranks: {error}")
    if data_vocab > config.vocab_size:
        raise ConfigError(
            f"model.vocab_size: the model has {config.vocab_size} token ids but the data uses {data_vocab} "
            "(set model.vocab_size or use data tokenized for this model)"
        )
    if init_from is not None:
        # each rank reads only its own slices of the checkpoint
        model = load_sharded_hf_checkpoint(
            init_from, parallel_groups, dtype=dtype, device=device, sequence_parallel=sequence_parallel, **overrides
        )
    else:
        # built on the device in the training dtype: a float32 copy first would not fit for the large sizes
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = QwenHybridForCausalLM(config)
        finally:
            torch.set_default_dtype(previous_dtype)
        model = shard_model(model, parallel_groups, sequence_parallel=sequence_parallel)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing)
    model.loss_chunk_size = cfg.train.loss_chunk_size
    return model


def count_parameters(model: QwenHybridForCausalLM) -> int:
    """Parameters of the whole model, also when this rank holds only its tensor-parallel shard."""
    plan = getattr(model, "tensor_parallel_plan", None)
    total = 0
    for name, parameter in model.named_parameters():
        shard = plan.shards.get(name) if plan is not None else None
        total += parameter.numel() if shard is None else parameter.numel() // shard.local_size * shard.full_size
    return total


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms, biases and per-head scalars are not decayed."""
    decayed = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_profiler(device: torch.device, enabled: bool):
    """torch.profiler over one step (host ops, and GPU kernels on CUDA) when enabled, else a no-op
    context yielding None. Its timings are left out of the run summary and the backend comparison."""
    if not enabled:
        return nullcontext()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def write_profile(profiler, step_time: float, path: Path) -> dict:
    report, record = profile_summary(profiler, step_time)
    path.write_text(report)
    log.info(f"profile of this step written to {path}")
    return record


def train_step(engine, sampler: MicroBatchSampler, data_position: int, accumulation: int, device: torch.device,
               timer: KernelTimer | None) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches, then the optimizer step (DeepSpeed
    steps at the accumulation boundary). Returns the sum of the micro-batch losses."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for micro_step in range(accumulation):
        batch = sampler.rank_micro_batch(data_position, micro_step)
        input_ids = batch.input_ids.to(device, non_blocking=True)
        if timer is not None:
            timer.phase = "fwd"
        output = engine(
            input_ids,
            cu_seqlens=batch.cu_seqlens,  # on the CPU: the model keeps the host copy and moves it
            position_ids=batch.position_ids.to(device, non_blocking=True),
            labels=input_ids,
        )
        if timer is not None:
            timer.phase = "bwd"
        engine.backward(output.loss)
        engine.step()
        loss_sum += output.loss.detach().float()
    return loss_sum


def train(cfg: DictConfig) -> int:
    import deepspeed

    validate_config(cfg)
    rank, world_size, local_rank = init_distributed()
    check_parallel_layout(cfg, world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", force=True)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            # CPU runs use small models, whose ops are too short to gain from threads that only contend
            torch.set_num_threads(1)
    parallel_groups = init_parallel_groups(cfg.parallel.tp)  # after set_device: NCCL groups bind to it

    resume_point = None
    if cfg.train.resume is not None:
        resume_point = find_resume_point(str(cfg.train.resume), cfg.run_dir)
    run_dir = agree_on_run_dir(cfg, resume_point)
    if rank == 0:
        config_name = "config.yaml" if resume_point is None else f"config.resumed_{resume_point.tag}.yaml"
        (run_dir / config_name).write_text(OmegaConf.to_yaml(cfg, resolve=True))

    torch.manual_seed(cfg.train.seed)
    dataset = open_dataset(cfg, local_rank)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    model = build_model(cfg, device, dtype, dataset.vocab_size, parallel_groups)
    num_parameters = count_parameters(model)

    ds_config = deepspeed_config(cfg, on_cuda=device.type == "cuda")
    train_cfg = cfg.train
    optimizer_groups = parameter_groups(model, train_cfg.weight_decay)
    client_optimizer = None
    if not cfg.deepspeed.offload_optimizer:  # offloaded: DeepSpeed builds its CPU Adam over these groups
        client_optimizer = torch.optim.AdamW(
            optimizer_groups, lr=train_cfg.lr, betas=tuple(train_cfg.betas), fused=device.type == "cuda"
        )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=optimizer_groups if client_optimizer is None else None,
        optimizer=client_optimizer,
        lr_scheduler=lambda optimizer: warmup_cosine_scheduler(
            optimizer, train_cfg.warmup_steps, train_cfg.steps, train_cfg.min_lr_ratio
        ),
        config=ds_config,
        dist_init_required=False,
        # ZeRO partitions and averages over the data-parallel group; the gradient norm counts each shard once
        mpu=parallel_groups if cfg.parallel.tp > 1 else None,
    )

    state = TrainerState()
    if resume_point is not None:
        state = load_checkpoint(engine, resume_point, cfg.parallel.tp)
        log.info(f"resumed from {resume_point.checkpoints_dir / resume_point.tag} at step {state.step}")
    # the ranks of one tensor-parallel group read the same micro-batches
    dp_rank, dp_size = parallel_groups.dp_rank, parallel_groups.dp_size
    sampler = MicroBatchSampler(
        dataset, train_cfg.tokens_per_micro_batch, train_cfg.seq_len, train_cfg.seed, dp_rank, dp_size,
        document_boundaries=cfg.data.document_boundaries,
    )
    comparison = None
    if cfg.benchmark.compare_backends:
        comparison = BackendComparison(list(cfg.benchmark.compare_backends), cfg.benchmark.warmup_steps)
    timer = KernelTimer(engine.module, device) if cfg.benchmark.kernel_timing or comparison else None
    gdn_modules = [m for m in engine.module.modules() if isinstance(m, GatedDeltaRule)]

    metrics = None
    if rank == 0:
        metrics = MetricsLog(
            run_dir, OmegaConf.to_container(cfg.logger, resolve=True), OmegaConf.to_container(cfg, resolve=True),
            state.step if resume_point else None,
        )
        log.info(
            f"run directory {run_dir}\nmodel {cfg.model.init_from or cfg.model.name} ({num_parameters / 1e6:.1f}M parameters), "
            f"{world_size} rank(s) on {device.type} (tensor parallel {cfg.parallel.tp}"
            f"{', sequence parallel' if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1 else ''} x data parallel "
            f"{dp_size}), ZeRO-{cfg.deepspeed.zero_stage}, {cfg.train.precision}, "
            f"data {dataset.path} ({dataset.num_tokens} tokens)"
        )
    stop = StopRequest()
    tokens_per_step = train_cfg.tokens_per_micro_batch * train_cfg.gradient_accumulation * dp_size
    last_step = train_cfg.steps if train_cfg.stop_at_step is None else min(train_cfg.steps, train_cfg.stop_at_step)
    saved_step = state.step if resume_point is not None else None
    start_step = state.step
    progress = tqdm(total=train_cfg.steps, initial=state.step, desc="train", disable=rank != 0, dynamic_ncols=True)
    exit_code = 0
    step_records: list[dict] = []
    try:
        while state.step < last_step:
            step = state.step + 1
            if comparison is not None:
                backend = comparison.backend_for_step(step)
                for module in gdn_modules:
                    module.backend = backend
            lr = engine.get_lr()[0]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            profiled = step == cfg.benchmark.profile_step
            with step_profiler(device, enabled=profiled and rank == 0) as profiler:
                synchronize(device)
                step_start = time.perf_counter()
                loss_sum = train_step(engine, sampler, state.data_position, train_cfg.gradient_accumulation, device,
                                      timer)
                synchronize(device)
                step_time = time.perf_counter() - step_start
            profile_record = write_profile(profiler, step_time, run_dir / f"profile-step{step}.txt") if profiler else {}

            state.step = step
            state.data_position += train_cfg.gradient_accumulation * dp_size
            state.tokens_seen += tokens_per_step
            # one collective per step: the mean loss over ranks (the ranks of a tp group agree),
            # whether any rank was signalled, and the largest peak memory of any rank
            reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0
            mine = torch.stack([loss_sum / train_cfg.gradient_accumulation] + [
                torch.tensor(x, dtype=torch.float32, device=device)
                for x in (float(stop.signal_number is not None), peak_memory_gib(device), reserved)])
            everyone = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine)
            everyone = torch.stack(everyone).cpu()
            mean_loss = everyone[:, 0].sum().item() / world_size
            stop_now = everyone[:, 1].sum().item() > 0
            peak_gib, peak_reserved_gib = everyone[:, 2].max().item(), everyone[:, 3].max().item()

            grad_norm = engine.get_global_grad_norm()
            record = {
                "step": step,
                "loss": mean_loss,
                "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": tokens_per_step / step_time,
                "step_time_s": step_time,
                "peak_memory_gib": peak_gib,  # the largest over ranks
                **({"peak_memory_reserved_gib": peak_reserved_gib} if device.type == "cuda" else {}),
                "tokens_seen": state.tokens_seen,
                **profile_record,
            }
            if timer is not None:
                kernel_times = timer.collect()
                record.update(kernel_times)
                record["time/rest_s"] = step_time - sum(kernel_times.values())
            if comparison is not None:
                record["gdn_backend"] = comparison.backend_for_step(step)
                times = {"step_time_s": step_time, **{k: v for k, v in record.items() if k.startswith("time/")}}
                record.update(comparison.record(step, times, timed=not profiled))
            if metrics is not None:
                metrics.log(record)
                step_records.append(record)
            progress.update(1)
            progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")

            checkpoint_due = train_cfg.checkpoint_every > 0 and step % train_cfg.checkpoint_every == 0
            exiting = stop_now or step == last_step
            if checkpoint_due or (exiting and train_cfg.checkpoint_at_exit):
                save_checkpoint(engine, run_dir, state, train_cfg.keep_checkpoints)
                saved_step = step
            if stop_now:
                exit_code = 128 + (stop.signal_number or signal.SIGTERM)
                log.info(f"\nstopped by signal at step {step}; checkpoint saved in {run_dir}")
                break
        if state.step == train_cfg.steps and exit_code == 0:
            if comparison is not None and metrics is not None:
                metrics.log_comparison(comparison, state.step)
            if train_cfg.export_hf:
                export_hf(engine, run_dir, parallel_groups)
    except BaseException:
        # With several ranks a failure may leave the others blocked in a collective, where saving
        # would hang; the last periodic checkpoint stays valid either way.
        if world_size == 1 and state.step > start_step and saved_step != state.step and train_cfg.checkpoint_at_exit:
            log.warning(f"saving a checkpoint at step {state.step} before exiting on the error")
            save_checkpoint(engine, run_dir, state, train_cfg.keep_checkpoints)
        raise
    finally:
        progress.close()
        if timer is not None:
            timer.remove()
        if metrics is not None:
            metrics.log_run_summary(step_records, cfg.benchmark.warmup_steps)
            metrics.close()
    if rank == 0:
        log.info(f"done: step {state.step}, run directory {run_dir}")
    dist.barrier()
    dist.destroy_process_group()
    return exit_code


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="pretrain")
def main(cfg: DictConfig) -> None:
    try:
        exit_code = train(cfg)
    except (ConfigError, MissingMandatoryValue) as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    if exit_code:
        sys.exit(exit_code)


def _strip_launcher_arguments() -> None:
    """The deepspeed launcher appends --local_rank=N, which Hydra would reject; its env var carries the same."""
    args = sys.argv[1:]
    kept = []
    i = 0
    while i < len(args):
        if args[i].startswith("--local_rank=") or args[i].startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", args[i].split("=", 1)[1])
        elif args[i] in ("--local_rank", "--local-rank") and i + 1 < len(args):
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            i += 1
        else:
            kept.append(args[i])
        i += 1
    sys.argv[1:] = kept


if __name__ == "__main__":
    _strip_launcher_arguments()
    main()
