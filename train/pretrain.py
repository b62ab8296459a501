"""Pretrain or continue pretraining a Qwen3.5-style hybrid model with DeepSpeed.

    deepspeed [--num_gpus N] train/pretrain.py [experiment=NAME] [key=value ...]
    torchrun --nproc_per_node N train/pretrain.py ...
    python train/pretrain.py ...            (one process)

The config groups live in configs/ (see configs/pretrain.yaml). Every rank writes into one run
directory chosen by rank 0: metrics.jsonl, config.yaml, checkpoints/, hf_final/, wandb/.
parallel.tp=N splits every layer's heads over N consecutive ranks (they read the same data);
parallel.cp=N splits each packed sequence over N ranks (docs/context-parallel.md); the world size /
(tp x cp) data-parallel replicas, times cp, share ZeRO's partitions.

The run: `preflight` (every config and environment error, before anything is written), `setup`
(processes, run directory, data, model, engine, resume), `train_loop` (one `train_step` per
optimizer step, then the step's one collective, the divergence guard, metrics and the checkpoint
policy). Exit codes: 0 done, 2 config error, 3 diverged, 128 + signal when stopped by one.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import sys
from contextlib import closing
from dataclasses import dataclass, field
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
from qwen_hybrid.attention import attention_kernels
from qwen_hybrid.checkpoint_io import read_config
from qwen_hybrid.parallel import (
    ParallelGroups,
    apply_context_parallel,
    context_parallel_slice,
    init_parallel_groups,
    load_sharded_hf_checkpoint,
    plan_context_parallel,
    plan_tensor_parallel,
    shard_model,
)
from train.checkpoint import (
    CHECKPOINTS_DIR,
    HF_EXPORT_DIR,
    ResumePoint,
    TrainerState,
    check_engine_saves_atomically,
    check_resume_point,
    export_hf,
    find_resume_point,
    load_checkpoint,
    new_run_id,
    save_checkpoint,
)
from train.config import (
    ConfigError,
    check_environment,
    check_parallel_layout,
    deepspeed_config,
    gdn_backends,
    validate_config,
    without_gradient_hooks,
)
from train.data import ByteTokenizer, MicroBatchSampler, PackedDataset
from train.embedded_corpus import embedded_documents
from train.metrics import (
    METRICS_FILE,
    WANDB_ID_FILE,
    MetricsLog,
    StepInstruments,
    matmul_parameters,
    peak_memory_gib,
    peak_tflops,
    training_flops,
)
from train.prepare_data import build_embedded_dataset, tokenize_documents
from train.schedule import warmup_cosine_scheduler
from train.zero_step import streamline_zero_step

log = logging.getLogger("train")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
EXIT_DIVERGED = 3
# What marks a run directory as holding a run: a fresh start there would mix two runs.
RUN_MARKERS = (METRICS_FILE, CHECKPOINTS_DIR, "config.yaml")


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


class DivergenceGuard:
    """Counts optimizer steps whose loss or gradient norm is not finite, or that DeepSpeed skipped.
    After `max_bad_steps` in a row the run has diverged; while a streak is open no checkpoint may
    be saved, so the last good one is never rotated out by frozen or NaN weights."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.streak: list[int] = []

    def observe(self, step: int, loss: float, grad_norm: float | None, skipped: bool) -> bool:
        bad = skipped or not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        self.streak = self.streak + [step] if bad else []
        return bad

    @property
    def in_bad_streak(self) -> bool:
        return bool(self.streak)

    @property
    def diverged(self) -> bool:
        return len(self.streak) >= self.max_bad_steps


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


def preflight(cfg: DictConfig) -> ResumePoint | None:
    """Every error the config and this machine can show before anything is written (run directory,
    dataset build): ConfigError naming the key. Returns where to resume from, if anywhere."""
    validate_config(cfg)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    check_parallel_layout(cfg, world_size)
    check_environment(cfg)
    tokens, data_vocab = _dataset_size(cfg)
    check_model_fits(cfg, model_config(cfg), data_vocab)
    if tokens < cfg.train.tokens_per_micro_batch:
        raise ConfigError(
            f"train.tokens_per_micro_batch={cfg.train.tokens_per_micro_batch}: the dataset "
            f"({cfg.data.path or 'embedded corpus, data.embedded_documents=' + str(cfg.data.embedded_documents)}) "
            f"holds only {tokens} tokens; expected at least one micro-batch"
        )
    resume_point = None
    if cfg.train.resume is not None:
        try:
            resume_point = find_resume_point(str(cfg.train.resume), cfg.run_dir)
        except ValueError as error:  # the checkpoint module's errors already start with the key
            message = str(error)
            if not message.startswith("train.resume"):
                message = f"train.resume={cfg.train.resume!r}: {message}"
            raise ConfigError(message) from error
        if resume_point is not None:
            check_resume_point(resume_point, cfg.parallel.tp, cfg.train.steps, world_size)
    if cfg.run_dir is not None and cfg.train.resume is None and not cfg.train.overwrite:
        found = [name for name in RUN_MARKERS if (Path(str(cfg.run_dir)) / name).exists()]
        if found:
            raise ConfigError(
                f"run_dir={cfg.run_dir!r}: holds an earlier run ({', '.join(found)}); continue it with "
                "train.resume=auto, replace it with train.overwrite=true, or choose another run_dir"
            )
    return resume_point


def _dataset_size(cfg: DictConfig) -> tuple[int, int]:
    """(tokens, vocabulary size) of the dataset the run will read, without building it."""
    if cfg.data.path is not None:
        try:
            dataset = PackedDataset(cfg.data.path)
        except (ValueError, OSError) as error:
            raise ConfigError(f"data.path={cfg.data.path!r}: {error}") from error
        return dataset.num_tokens, dataset.vocab_size
    # what build_embedded_dataset will write, counted without writing it
    tokenizer = ByteTokenizer()
    documents = tokenize_documents(embedded_documents(cfg.data.embedded_documents), tokenizer)
    return sum(len(ids) for ids in documents), tokenizer.vocab_size


def config_overrides(cfg: DictConfig) -> dict:
    """What model.* sets over the named size or the checkpoint's config.json."""
    overrides = {"gdn_backend": cfg.model.gdn_backend, "conv_backend": cfg.model.conv_backend,
                 "attention_backend": cfg.model.attention_backend,
                 "gdn_keep_for_backward": cfg.model.gdn_keep_for_backward}
    if cfg.model.vocab_size is not None:
        overrides["vocab_size"] = cfg.model.vocab_size
    return overrides


def model_config(cfg: DictConfig) -> QwenHybridConfig:
    """The whole model's config: the named size or model.init_from's config.json, with overrides."""
    overrides = config_overrides(cfg)
    if cfg.model.init_from is not None:
        return QwenHybridConfig.from_hf(read_config(cfg.model.init_from), **overrides)
    return QwenHybridConfig.named(cfg.model.name, **overrides)


def check_model_fits(cfg: DictConfig, config: QwenHybridConfig, data_vocab: int) -> None:
    """What the model's shapes must satisfy: the tp and cp splits, the data's token ids, the
    kernels the GDN backend names."""
    tp, cp, sequence_parallel = cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.sequence_parallel
    name = cfg.model.init_from or cfg.model.name
    try:
        plan_tensor_parallel(config, tp, 0, sequence_parallel)
    except ValueError as error:
        raise ConfigError(f"parallel.tp={tp}: model {name} does not split over {tp} ranks: {error}")
    try:
        plan_context_parallel(config, cp, 0, tp)
    except ValueError as error:
        raise ConfigError(f"parallel.cp={cp}: model {name} does not split over {cp} ranks "
                          f"(with parallel.tp={tp}): {error}")
    layers = cfg.train.checkpoint_layers
    if layers is not None and layers > config.num_hidden_layers:
        raise ConfigError(f"train.checkpoint_layers={layers}: model {name} has {config.num_hidden_layers} layers")
    if data_vocab > config.vocab_size:
        raise ConfigError(
            f"model.vocab_size: the model has {config.vocab_size} token ids but the data uses {data_vocab} "
            "(set model.vocab_size or use data tokenized for this model)"
        )
    head_dims = (config.linear_key_head_dim, config.linear_value_head_dim)
    for key, backend in gdn_backends(cfg):
        if backend == "tilelang" and head_dims != (128, 128):
            raise ConfigError(f"{key}='tilelang': the kernels take GDN head dims K = V = 128, model {name} has "
                              f"K = {head_dims[0]}, V = {head_dims[1]} (use 'auto' or 'torch')")
        if backend == "tilelang" and cfg.train.precision != "bf16":
            raise ConfigError(f"{key}='tilelang': the kernels take bf16 or fp16 activations, expected "
                              f"train.precision=bf16, got {cfg.train.precision!r} (use 'auto' or 'torch')")


def agree_on_run_dir(cfg: DictConfig, resume_point: ResumePoint | None) -> Path:
    """Rank 0 picks the run directory (one timestamp for all) and, with train.overwrite, clears
    the earlier run in it; the others receive the path."""
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
        run_dir = Path(chosen[0])
        if cfg.train.overwrite and cfg.train.resume is None:
            for name in RUN_MARKERS + (HF_EXPORT_DIR, WANDB_ID_FILE):
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
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
    config = model_config(cfg)
    check_model_fits(cfg, config, data_vocab)  # preflight asked already; callers without it get the same errors
    init_from, sequence_parallel = cfg.model.init_from, cfg.parallel.sequence_parallel
    if init_from is not None:
        # each rank reads only its own slices of the checkpoint
        model = load_sharded_hf_checkpoint(
            init_from, parallel_groups, dtype=dtype, device=device, sequence_parallel=sequence_parallel,
            **config_overrides(cfg),
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
    model = apply_context_parallel(model, parallel_groups)
    # auto: the first two steps recompute, then keep_attention_by_memory decides
    model.set_activation_checkpointing(cfg.train.activation_checkpointing,
                                       recompute_attention=cfg.train.recompute_attention is not False,
                                       layers=cfg.train.checkpoint_layers)
    model.loss_chunk_size = cfg.train.loss_chunk_size
    return model


def count_parameters(model: QwenHybridForCausalLM) -> int:
    """Parameters of the whole model, also when this rank holds only its tensor-parallel shard."""
    plan = model.tensor_parallel_plan
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


def build_engine(cfg: DictConfig, model: QwenHybridForCausalLM, device: torch.device, groups: ParallelGroups):
    import deepspeed

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
        config=deepspeed_config(cfg, on_cuda=device.type == "cuda", data_parallel_size=groups.get_data_parallel_world_size()),
        dist_init_required=False,
        # ZeRO partitions and averages over the ranks holding equal parameters (dp x cp); the gradient
        # norm counts each tensor-parallel shard once
        mpu=groups if cfg.parallel.tp * cfg.parallel.cp > 1 else None,
    )
    if cfg.deepspeed.one_pass_grad_checks and cfg.deepspeed.zero_stage in (1, 2):
        reason = streamline_zero_step(engine.optimizer)
        if reason is not None:
            log.info("deepspeed.one_pass_grad_checks: not applied, %s", reason)
    return engine


@dataclass
class Run:
    """Everything the loop needs, made once by `setup`."""

    cfg: DictConfig
    rank: int
    world_size: int
    device: torch.device
    groups: ParallelGroups
    run_dir: Path
    engine: object
    sampler: MicroBatchSampler
    state: TrainerState
    resumed: bool
    instruments: StepInstruments
    metrics: MetricsLog | None
    tokens_per_step: int
    matmul_params: int  # of the whole model, for the FLOP count
    peak_tflops: float | None  # per GPU, for MFU
    records: list[dict] = field(default_factory=list)


def setup(cfg: DictConfig, resume_point: ResumePoint | None) -> Run:
    import deepspeed

    rank, world_size, local_rank = init_distributed()
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
    groups = init_parallel_groups(cfg.parallel.tp, cfg.parallel.cp)  # after set_device: NCCL groups bind to it

    run_dir = agree_on_run_dir(cfg, resume_point)
    if rank == 0:
        config_name = "config.yaml" if resume_point is None else f"config.resumed_{resume_point.tag}.yaml"
        (run_dir / config_name).write_text(OmegaConf.to_yaml(cfg, resolve=True))

    torch.manual_seed(cfg.train.seed)
    dataset = open_dataset(cfg, local_rank)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    model = build_model(cfg, device, dtype, dataset.vocab_size, groups)
    num_parameters = count_parameters(model)
    engine = build_engine(cfg, model, device, groups)
    check_engine_saves_atomically(engine)  # DeepSpeed settings the checkpoints cannot honour, before step 1

    state = TrainerState(run_id=new_run_id())
    if resume_point is not None:
        state = load_checkpoint(engine, resume_point, cfg.parallel.tp)
        log.info(f"resumed from {resume_point.checkpoints_dir / resume_point.tag} at step {state.step}")
    train_cfg = cfg.train
    # the ranks of one tensor- or context-parallel group read the same micro-batches
    sampler = MicroBatchSampler(
        dataset, train_cfg.tokens_per_micro_batch, train_cfg.seq_len, train_cfg.seed, groups.dp_rank, groups.dp_size,
        document_boundaries=cfg.data.document_boundaries,
    )
    metrics = None
    if rank == 0:
        # a requested resume that found no checkpoint starts at step 0: the dead run's lines go too
        resumed_step = state.step if cfg.train.resume is not None else None
        metrics = MetricsLog(run_dir, OmegaConf.to_container(cfg.logger, resolve=True),
                             OmegaConf.to_container(cfg, resolve=True), resumed_step)
        log.info(
            f"run directory {run_dir}\nmodel {cfg.model.init_from or cfg.model.name} ({num_parameters / 1e6:.1f}M parameters), "
            f"{world_size} rank(s) on {device.type} (tensor parallel {cfg.parallel.tp} x context parallel {cfg.parallel.cp}"
            f"{', sequence parallel' if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1 else ''} x data parallel "
            f"{groups.dp_size}), ZeRO-{cfg.deepspeed.zero_stage}"
            f"{' (as ZeRO-1 without gradient hooks: one data-parallel rank)' if without_gradient_hooks(cfg, groups.get_data_parallel_world_size()) else ''}, "
            f"{cfg.train.precision}, "
            f"data {dataset.path} ({dataset.num_tokens} tokens)\n"
            f"attention {attention_kernels(engine.module.config.attention_backend, device, dtype, engine.module.config.head_dim)}"
        )
    return Run(
        cfg=cfg, rank=rank, world_size=world_size, device=device, groups=groups, run_dir=run_dir, engine=engine,
        sampler=sampler, state=state, resumed=resume_point is not None,
        instruments=StepInstruments(cfg.benchmark, engine.module, device, run_dir, rank), metrics=metrics,
        tokens_per_step=train_cfg.tokens_per_micro_batch * train_cfg.gradient_accumulation * groups.dp_size,
        matmul_params=matmul_parameters(num_parameters, engine.module.config),
        peak_tflops=peak_tflops(device, cfg.benchmark.peak_tflops),
    )


def train_step(run: "Run", data_position: int) -> tuple[torch.Tensor, float]:
    """Forward and backward over this rank's micro-batches, then the optimizer step (DeepSpeed
    steps at the accumulation boundary). Returns the sum of the micro-batch losses and their
    model FLOPs."""
    engine, device, instruments = run.engine, run.device, run.instruments
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    flops = 0.0
    for micro_step in range(run.cfg.train.gradient_accumulation):
        batch = run.sampler.rank_micro_batch(data_position, micro_step)
        flops += training_flops(run.matmul_params, engine.module.config, batch.cu_seqlens.diff().tolist())
        instruments.phase("fwd")
        output = engine(**model_inputs(batch, run.groups, device))
        instruments.phase("bwd")
        engine.backward(output.loss)
        engine.step()
        loss_sum += output.loss.detach().float()
    return loss_sum, flops


def model_inputs(batch, groups: ParallelGroups, device: torch.device) -> dict:
    """The model's arguments for this rank: the whole micro-batch, or under context parallelism
    this rank's slice with its targets shifted over the whole sequence. cu_seqlens stays on the
    CPU: the model keeps the host copy, moves it, and derives the positions in documents from it."""
    if groups.cp_size == 1:
        input_ids = batch.input_ids.to(device, non_blocking=True)
        return dict(input_ids=input_ids, cu_seqlens=batch.cu_seqlens, labels=input_ids)
    part = context_parallel_slice(batch.input_ids, batch.cu_seqlens, cp_size=groups.cp_size, cp_rank=groups.cp_rank)
    return {name: value if name == "cu_seqlens" else value.to(device, non_blocking=True)
            for name, value in part.model_inputs().items()}


@dataclass
class StepSummary:
    """What every rank agrees on after a step (from its one collective)."""

    loss: float
    stop_requested: bool
    peak_gib: float
    peak_reserved_gib: float
    flops: float  # model FLOPs of the whole step, all data-parallel replicas


def agree_on_step(run: Run, loss_sum: torch.Tensor, flops: float, stop: StopRequest) -> StepSummary:
    """One collective per step: the mean loss over ranks (the ranks of a tp group agree), whether
    any rank was signalled, the largest peak memory of any rank, and the step's FLOPs."""
    device = run.device
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0
    mine = torch.stack([loss_sum / run.cfg.train.gradient_accumulation] + [
        torch.tensor(x, dtype=torch.float32, device=device)
        for x in (float(stop.signal_number is not None), peak_memory_gib(device), reserved, flops / 1e12)])
    everyone = [torch.empty_like(mine) for _ in range(run.world_size)]
    dist.all_gather(everyone, mine)
    everyone = torch.stack(everyone).cpu().double()
    return StepSummary(
        loss=everyone[:, 0].sum().item() / run.world_size, stop_requested=everyone[:, 1].sum().item() > 0,
        peak_gib=everyone[:, 2].max().item(), peak_reserved_gib=everyone[:, 3].max().item(),
        # the ranks of a tensor- or context-parallel group count the same tokens: count them once
        flops=everyone[:, 4].sum().item() * 1e12 / (run.cfg.parallel.tp * run.cfg.parallel.cp),
    )


# Of the GPU's memory, what train.recompute_attention=auto lets the step's peak reach with the kept
# attention tensors added: the rest covers fragmentation that grows with the new tensors.
ATTENTION_KEEP_MEMORY_FRACTION = 0.9


def attention_layers_to_keep(peak_reserved: float, total: float, bytes_per_layer: float, layers: int,
                             fraction: float = ATTENTION_KEEP_MEMORY_FRACTION) -> int:
    """How many of `layers` checkpointed attention layers can keep their kernel's tensors: a step's
    peak reserved memory with all of them recomputing, plus bytes_per_layer for each kept one, stays
    within fraction * total."""
    if layers == 0 or bytes_per_layer <= 0:
        return layers
    return max(0, min(layers, int((fraction * total - peak_reserved) // bytes_per_layer)))


@dataclass(frozen=True)
class AttentionKeep:
    """What keep_attention_by_memory decided, and from what (bytes), for the one look after the next step."""

    peak_reserved: float  # the step's peak reserved memory, every attention layer recomputing
    total: float          # the smallest GPU's memory
    per_layer: float      # kept_attention_bytes: the estimate
    layers: int           # checkpointed attention layers
    kept: int


def keep_attention_by_memory(run: Run, summary: StepSummary) -> AttentionKeep | None:
    """train.recompute_attention=auto: after the process's second step, both recomputing every
    checkpointed attention layer (the second is the first whose backward runs with the optimizer's
    state allocated), keep the attention kernel's tensors in as many as the GPU's memory holds (from the
    largest peak over ranks, so every rank decides alike) from the next step on. Context parallelism
    keeps recomputing: its attention layers hold a head group's whole sequence, which the estimate
    leaves out. Returns what keep_more_attention_by_measure needs, or None where nothing was decided."""
    model = run.engine.module
    layers = len(model.checkpointed_attention())
    if run.device.type != "cuda" or layers == 0:
        return None
    if run.cfg.parallel.cp > 1:
        log.info("train.recompute_attention=auto: attention recomputed (context parallelism)")
        return None
    per_layer = model.kept_attention_bytes(run.cfg.train.tokens_per_micro_batch)
    total = float(torch.cuda.mem_get_info(run.device)[1])
    if run.world_size > 1:  # the smallest GPU decides: ranks that kept different layers would differ in
        smallest = torch.tensor(total, device=run.device)  # their backward's collectives under tp
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        total = smallest.item()
    peak_reserved = summary.peak_reserved_gib * 2**30
    kept = attention_layers_to_keep(peak_reserved, total, per_layer, layers)
    model.keep_attention_tensors(kept)
    log.info(f"train.recompute_attention=auto: {kept} of {layers} checkpointed attention layers keep the kernel's "
             f"tensors from step {run.state.step + 1} (step {run.state.step} peaked at {summary.peak_reserved_gib:.1f} "
             f"GiB reserved of {total / 2**30:.1f}; up to {per_layer / 2**30:.2f} GiB a kept layer)")
    return AttentionKeep(peak_reserved, total, per_layer, layers, kept)


def keep_more_attention_by_measure(run: Run, summary: StepSummary, decision: AttentionKeep | None) -> None:
    """train.recompute_attention=auto, after the first step with some but not all layers kept: what a
    kept layer costs, measured (the rise of the peak reserved memory over the step before it, per kept
    layer), in place of the estimate, an upper bound by construction (docs/performance.md has both for
    0.8B at 393216 and 524288 tokens); more layers keep theirs from the next step where the measure lets
    them, never fewer. The measure is taken as at least half the estimate, against a rise hidden in
    blocks the allocator had reserved already."""
    if decision is None or not 0 < decision.kept < decision.layers:
        return
    rise = summary.peak_reserved_gib * 2**30 - decision.peak_reserved
    measured = max(rise / decision.kept, 0.5 * decision.per_layer)
    kept = attention_layers_to_keep(decision.peak_reserved, decision.total, measured, decision.layers)
    if kept <= decision.kept:
        return
    run.engine.module.keep_attention_tensors(kept)
    log.info(f"train.recompute_attention=auto: {kept} of {decision.layers} checkpointed attention layers keep the "
             f"kernel's tensors from step {run.state.step + 1} ({decision.kept} kept in step {run.state.step} raised "
             f"its peak reserved memory by {rise / 2**30:.1f} GiB: {measured / 2**30:.2f} GiB a layer against "
             f"{decision.per_layer / 2**30:.2f} estimated)")


def out_of_memory_hint(run: Run, error: BaseException) -> str | None:
    """What to change when the GPU ran out of memory with attention layers keeping their tensors
    (train.recompute_attention=false, or auto's choice); None for other errors."""
    if not isinstance(error, torch.cuda.OutOfMemoryError) or not run.cfg.train.activation_checkpointing:
        return None
    kept = run.engine.module.kept_attention_layers()
    if kept == 0:
        return None
    chose = "auto kept" if run.cfg.train.recompute_attention == "auto" else "train.recompute_attention=false keeps"
    return (f"out of memory at step {run.state.step + 1} while {chose} the attention kernel's tensors in {kept} "
            f"layer(s): rerun with train.recompute_attention=true (train.resume=auto continues from the last "
            f"checkpoint)")


def checkpoint_due(train_cfg: DictConfig, step: int, exiting: bool) -> bool:
    periodic = train_cfg.checkpoint_every > 0 and step % train_cfg.checkpoint_every == 0
    return periodic or (exiting and train_cfg.checkpoint_at_exit)


def train_loop(run: Run) -> int:
    """Steps until train.steps (or train.stop_at_step), a signal, or divergence; returns the exit code."""
    cfg, state, engine = run.cfg, run.state, run.engine
    train_cfg = cfg.train
    stop = StopRequest()
    guard = DivergenceGuard(train_cfg.max_bad_steps)
    last_step = train_cfg.steps if train_cfg.stop_at_step is None else min(train_cfg.steps, train_cfg.stop_at_step)
    saved_step = state.step if run.resumed else None
    start_step, skipped_before = state.step, engine.skipped_steps
    attention_keep = None  # train.recompute_attention=auto's decision after the second step
    progress = tqdm(total=train_cfg.steps, initial=state.step, desc="train", disable=run.rank != 0, dynamic_ncols=True)
    try:
        while state.step < last_step:
            step = state.step + 1
            lr = engine.get_lr()[0]
            with run.instruments.step(step) as timing:
                loss_sum, flops = train_step(run, state.data_position)
                # counted as soon as the optimizer stepped, so a save on error names the weights it holds
                state.step = step
                state.data_position += train_cfg.gradient_accumulation * run.groups.dp_size
                state.tokens_seen += run.tokens_per_step
            summary = agree_on_step(run, loss_sum, flops, stop)

            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            skipped = engine.skipped_steps > skipped_before
            skipped_before = engine.skipped_steps
            bad = guard.observe(step, summary.loss, grad_norm, skipped)
            record = step_record(run, lr, summary, grad_norm, bad, timing)
            if run.metrics is not None:
                run.metrics.log(record)
                run.records.append(record)
            progress.update(1)
            progress.set_postfix(loss=f"{summary.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            # after the step's record, which counts the layers this step kept
            if train_cfg.recompute_attention == "auto" and step == start_step + 2:
                attention_keep = keep_attention_by_memory(run, summary)
            elif train_cfg.recompute_attention == "auto" and step == start_step + 3:
                keep_more_attention_by_measure(run, summary, attention_keep)

            if guard.diverged:
                log.error(
                    f"training diverged: {len(guard.streak)} steps in a row ({guard.streak[0]}-{step}) had a non-finite "
                    f"loss or gradient norm or were skipped by DeepSpeed (loss {summary.loss}, grad norm {grad_norm}, "
                    f"train.max_bad_steps={train_cfg.max_bad_steps}); stopping without saving. "
                    f"{_last_good(saved_step, run.run_dir)}; lower train.lr or raise train.max_bad_steps"
                )
                return EXIT_DIVERGED
            exiting = summary.stop_requested or step == last_step
            if checkpoint_due(train_cfg, step, exiting):
                if guard.in_bad_streak:
                    log.warning(f"step {step}: checkpoint not saved, the last {len(guard.streak)} step(s) were bad")
                else:
                    save_checkpoint(engine, run.run_dir, state, train_cfg.keep_checkpoints)
                    saved_step = step
            if summary.stop_requested:
                log.info(f"\nstopped by signal at step {step}; last checkpoint: step {saved_step} in {run.run_dir}")
                return 128 + (stop.signal_number or signal.SIGTERM)
        return finish(run, guard, saved_step)
    except BaseException as error:
        hint = out_of_memory_hint(run, error)
        if hint is not None:
            log.error(hint)
        # With several ranks a failure may leave the others blocked in a collective, where saving
        # would hang; the last periodic checkpoint stays valid either way. Saved only where the
        # weights are those of state.step (an error inside the step leaves them unknown).
        if (run.world_size == 1 and state.step > start_step and saved_step != state.step
                and engine.global_steps == state.step and train_cfg.checkpoint_at_exit and not guard.in_bad_streak):
            log.warning(f"saving a checkpoint at step {state.step} before exiting on the error")
            save_checkpoint(engine, run.run_dir, state, train_cfg.keep_checkpoints)
        raise
    finally:
        progress.close()


def step_record(run: Run, lr: float, summary: StepSummary, grad_norm: float | None, bad: bool, timing) -> dict:
    """The step's line in metrics.jsonl and W&B (run.state already counts the step)."""
    seconds = timing.seconds
    return {
        "step": run.state.step,
        "loss": summary.loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": run.tokens_per_step / seconds,
        "step_time_s": seconds,
        "model_tflops_per_s": summary.flops / seconds / 1e12,
        **({"mfu": summary.flops / seconds / 1e12 / (run.world_size * run.peak_tflops)} if run.peak_tflops else {}),
        "peak_memory_gib": summary.peak_gib,  # the largest over ranks
        **({"peak_memory_reserved_gib": summary.peak_reserved_gib} if run.device.type == "cuda" else {}),
        "tokens_seen": run.state.tokens_seen,
        # checkpointed attention layers keeping the kernel's tensors (train.recompute_attention)
        **({"attention_layers_kept": run.engine.module.kept_attention_layers()}
           if run.cfg.train.activation_checkpointing else {}),
        "skipped_steps": run.engine.skipped_steps,
        "bad_step": bad,
        **run.instruments.record(run.state.step, timing),
    }


def finish(run: Run, guard: DivergenceGuard, saved_step: int | None) -> int:
    """After the last step of this process: exit 3 without export when it ended in bad steps;
    at train.steps, the backend comparison's summary and the HF export."""
    if guard.in_bad_streak:
        log.error(
            f"the run ended at step {run.state.step} in {len(guard.streak)} bad step(s) (from step {guard.streak[0]}); "
            f"neither a checkpoint nor the HF export was written. {_last_good(saved_step, run.run_dir)}"
        )
        return EXIT_DIVERGED
    if run.state.step == run.cfg.train.steps:
        if run.metrics is not None:
            run.instruments.log_comparison(run.metrics, run.state.step)
        if run.cfg.train.export_hf:
            export_hf(run.engine, run.run_dir, run.groups)
    return 0


def _last_good(saved_step: int | None, run_dir: Path) -> str:
    if saved_step is None:
        return "No checkpoint of this run was saved"
    return f"The last good checkpoint (step {saved_step}) is kept in {run_dir / CHECKPOINTS_DIR}"


def train(cfg: DictConfig) -> int:
    resume_point = preflight(cfg)
    run = setup(cfg, resume_point)
    try:
        exit_code = train_loop(run)
    finally:
        run.instruments.close()
        if run.metrics is not None:
            run.metrics.log_run_summary(run.records, cfg.benchmark.warmup_steps)
            run.metrics.close()
    if run.rank == 0:
        log.info(f"done: step {run.state.step}, run directory {run.run_dir}")
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
