"""Tensor parallelism (qwen_hybrid/parallel) against the unsharded model: on CPU over gloo
(2 and 4 processes, shared by the tests), and on two GPUs over NCCL (marked gpu).

Every rank builds the same model, keeps an unsharded copy as the reference and compares its
sharded copy to it: loss, logits, every gradient, optimizer steps, checkpoints. Run with
`python -m pytest tests/qwen_hybrid/test_tensor_parallel.py` (the gpu test: `-m gpu` on a 2-GPU machine).
"""
from __future__ import annotations

import copy
import os
import queue
import re
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashqla.testing import relative_error
from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from qwen_hybrid.parallel import (
    init_parallel_groups,
    load_sharded_hf_checkpoint,
    plan_tensor_parallel,
    save_hf_checkpoint,
    shard_model,
)
from qwen_hybrid.loss import chunked_cross_entropy
from qwen_hybrid.parallel.vocab import vocab_parallel_cross_entropy

TOLERANCE = 1e-5
# tp = 4 needs 4 GDN key heads; attention keeps 2 KV heads, so at tp = 4 each is replicated on 2 ranks
TP4_OVERRIDES = dict(linear_num_key_heads=4, linear_num_value_heads=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ProcessWorld:
    """`world_size` spawned processes in one process group (gloo on CPU; nccl with one GPU a
    rank), kept for several tests (each process pays ~3 s of imports once).

    `run(worker, *args)` calls `worker(*args)` on every rank and fails with the traceback of the
    first rank that failed; the processes are then killed (the others may be stuck in a
    collective) and the next `run` starts fresh ones."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 300.0):
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.processes = []

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self.tasks = [context.Queue() for _ in range(self.world_size)]
        self.results = context.Queue()
        port = _free_port()
        self.processes = [
            context.Process(
                target=_serve,
                args=(rank, self.world_size, self.backend, port, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, worker, *args) -> None:
        if not self.processes:
            self._start()
        for tasks in self.tasks:
            tasks.put((worker, args))
        failures = []
        try:
            for _ in range(self.world_size):
                rank, error = self.results.get(timeout=self.timeout_s)
                if error is not None:
                    failures.append(f"rank {rank}:\n{error}")
                    break  # the other ranks may now wait forever in a collective
        except queue.Empty:
            failures.append(f"a rank did not finish within {self.timeout_s} s (stuck in a collective?)")
        if failures:
            self.close(wait_s=2.0)
            pytest.fail("\n".join(failures), pytrace=False)

    def close(self, wait_s: float = 10.0) -> None:
        for process, tasks in zip(self.processes, self.tasks):
            if process.is_alive():
                tasks.put(None)
        for process in self.processes:
            process.join(timeout=wait_s)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []


def _serve(rank: int, world_size: int, backend: str, port: int, tasks, results) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))  # DeepSpeed reads them
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    while (task := tasks.get()) is not None:
        worker, args = task
        try:
            worker(*args)
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world2():
    world = _ProcessWorld(2)
    yield world
    world.close()


@pytest.fixture(scope="module")
def world4():
    world = _ProcessWorld(4)
    yield world
    world.close()


def _tiny_config(**overrides) -> QwenHybridConfig:
    return QwenHybridConfig.named("tiny", gdn_backend="torch", **overrides)


def _random_model(config: QwenHybridConfig, seed: int = 0) -> QwenHybridForCausalLM:
    """Every parameter random, norm weights included (HF initialises them to constants)."""
    torch.manual_seed(seed)
    model = QwenHybridForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(-2.0, 1.0, generator=generator))
            elif param.dim() == 1:
                offset = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + offset)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.08)
    model.loss_chunk_size = 16  # several loss chunks per step
    return model


def _packed_batch(config: QwenHybridConfig, seed: int, num_tokens: int = 40):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (1, num_tokens), generator=generator)
    labels = input_ids.clone()
    labels[0, 5:8] = -100
    cu_seqlens = torch.tensor([0, 13, 29, num_tokens], dtype=torch.int32)
    return input_ids, cu_seqlens, labels


def _forward_backward(model, input_ids, cu_seqlens, labels, logits_probe):
    """Loss and gradients; with `logits_probe` also the logits, which then get a gradient too."""
    out = model(input_ids, cu_seqlens=cu_seqlens, labels=labels, return_logits=logits_probe is not None)
    objective = out.loss if logits_probe is None else out.loss + (out.logits * logits_probe).sum()
    objective.backward()
    return out


def _sharded_copy(reference, groups, activation_checkpointing=False, sequence_parallel=False) -> QwenHybridForCausalLM:
    model = copy.deepcopy(reference)
    if groups.tp_rank != 0:
        with torch.no_grad():  # shard_model must take the weights of the group's first rank
            for param in model.parameters():
                param.add_(1.0)
    shard_model(model, groups, sequence_parallel=sequence_parallel)
    model.set_activation_checkpointing(activation_checkpointing)
    return model


def _outputs_and_gradients(model, reference, got, expected) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (sharded value, unsharded value cut to this rank's shard) for the loss, the logits
    and every gradient."""
    plan = model.tensor_parallel_plan
    pairs = {"loss": (got.loss.detach(), expected.loss.detach())}
    if got.logits is not None:
        pairs["logits"] = (got.logits.detach(), expected.logits.detach())
    reference_params = dict(reference.named_parameters())
    assert len(reference_params) == len(dict(model.named_parameters()))
    for name, param in model.named_parameters():
        want = reference_params[name]
        shard = plan.shards.get(name)
        want_value = shard.take(want.detach()) if shard else want.detach()
        assert param.shape == want_value.shape and torch.equal(param.detach(), want_value), name
        pairs[f"grad {name}"] = (param.grad, shard.take(want.grad) if shard else want.grad)
    return pairs


def _float32_floor(config: QwenHybridConfig, num_tokens: int) -> float:
    """float32 rounding noise allowed in a sharded result, relative to its float64 norm (that is,
    an absolute floor of this times ||float64 value||): eps per rounding, two roundings (forward and
    backward) per token summed (num_tokens) in each layer passed (num_hidden_layers), the worst-case
    linear growth. Needed because a cancelling 2-element gradient (dt_bias) can be correct and still
    3x further from float64 than the unsharded model is (7.8e-6 against 2.4e-6 at tp = 4; 2.0e-5
    against 9.1e-6 at tp = 2 on a Xeon whose float32 sums round in another order)."""
    return 2 * torch.finfo(torch.float32).eps * config.num_hidden_layers * num_tokens


def _check_sharded_runs(
    make_reference, batch, logits_probe, groups, dtypes, activation_checkpointing=False, sequence_parallel=False
) -> None:
    """Run the unsharded model and its sharded copy in each dtype (the first must be float64) on
    `batch`. float64: the loss, logits and every gradient within 1e-5 of the unsharded model (the
    norms compute in float32 even then; errors stay near 1e-6, a wrong shard or sum is off by >1e-2).
    Other dtypes: within 1e-5, or, where that dtype cannot resolve 1e-5, no further from float64
    than 2x the unsharded model is, or than float32's rounding floor `_float32_floor` (+1e-3 in bf16)."""
    assert dtypes[0] == torch.float64
    num_tokens = batch[0].shape[1]
    truth = None
    for dtype in dtypes:
        reference = make_reference(dtype)
        model = _sharded_copy(reference, groups, activation_checkpointing, sequence_parallel)
        layer_input_tokens = []
        model.model.layers[0].register_forward_pre_hook(lambda _, args: layer_input_tokens.append(args[0].shape[1]))
        probe = None if logits_probe is None else logits_probe.to(dtype)
        expected = _forward_backward(reference, *batch, probe)
        got = _forward_backward(model, *batch, probe)
        assert layer_input_tokens[0] == (num_tokens // groups.tp_size if sequence_parallel else num_tokens)
        pairs = _outputs_and_gradients(model, reference, got, expected)
        if truth is None:
            truth = {name: unsharded for name, (_, unsharded) in pairs.items()}
            for name, (sharded, unsharded) in pairs.items():
                error = relative_error(sharded, unsharded)
                assert error <= TOLERANCE, (
                    f"rank {groups.tp_rank}: float64 {name} off by {error:.2e} from the unsharded model, "
                    f"expected <= {TOLERANCE:.0e}"
                )
            continue
        slack = 1e-3 if dtype == torch.bfloat16 else 0.0
        rounding_floor = _float32_floor(reference.config, num_tokens) if dtype == torch.float32 else 0.0
        for name, (sharded, unsharded) in pairs.items():
            error = relative_error(sharded, unsharded)
            if error > TOLERANCE:
                floor = relative_error(unsharded, truth[name])
                from_truth = relative_error(sharded, truth[name])
                allowed = max(2 * floor, rounding_floor) + slack
                assert from_truth <= allowed, (
                    f"rank {groups.tp_rank}: {dtype} {name} off by {error:.2e} from the unsharded model and "
                    f"{from_truth:.2e} from float64, expected <= {allowed:.2e} (the unsharded {dtype} model is "
                    f"{floor:.2e} off; float32 rounding floor {rounding_floor:.2e})"
                )
        del reference, model, expected, got, pairs


def _check_matches_unsharded(config_overrides: dict, activation_checkpointing: bool, sequence_parallel: bool) -> None:
    groups = init_parallel_groups(dist.get_world_size())
    config = _tiny_config(**config_overrides)
    batch = _packed_batch(config, seed=1)
    logits_probe = torch.randn(1, batch[0].shape[1], config.vocab_size, generator=torch.Generator().manual_seed(2))
    _check_sharded_runs(
        lambda dtype: _random_model(config).to(dtype), batch, logits_probe, groups, (torch.float64, torch.float32),
        activation_checkpointing, sequence_parallel,
    )


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_logits_loss_and_gradients_match_unsharded(world2, sequence_parallel):
    world2.run(_check_matches_unsharded, {}, False, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp4_with_replicated_kv_heads_and_activation_checkpointing_matches_unsharded(world4, sequence_parallel):
    plan = plan_tensor_parallel(_tiny_config(**TP4_OVERRIDES), 4, 1)
    assert plan.shards["model.layers.1.self_attn.k_proj.weight"].copies == 2
    world4.run(_check_matches_unsharded, TP4_OVERRIDES, True, sequence_parallel)


def _check_training_follows_unsharded(num_steps: int, directory: str) -> None:
    groups = init_parallel_groups(dist.get_world_size())
    config = _tiny_config()
    reference = _random_model(config, seed=3)
    model = shard_model(copy.deepcopy(reference), groups)
    losses = {}
    for key, net in (("unsharded", reference), ("sharded", model)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
        losses[key] = []
        for step in range(num_steps):
            input_ids, cu_seqlens, labels = _packed_batch(config, seed=10 + step)
            loss = net(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[key].append(loss.item())
    expected, got = torch.tensor(losses["unsharded"]), torch.tensor(losses["sharded"])
    assert expected[-1] < expected[0], f"the reference run did not learn: {expected.tolist()}"
    assert relative_error(got, expected) <= 1e-5, (got.tolist(), expected.tolist())
    # the shards still assemble into the unsharded weights after the updates, and load back
    save_hf_checkpoint(model, groups, directory)
    dist.barrier()
    saved = QwenHybridForCausalLM.from_pretrained(directory, gdn_backend="torch").state_dict()
    for name, tensor in reference.state_dict().items():
        assert relative_error(saved[name], tensor) <= 1e-5, name
    reloaded = load_sharded_hf_checkpoint(directory, groups, gdn_backend="torch").state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name


def test_tp2_optimizer_steps_follow_unsharded_loss_curve_and_save_unsharded(world2, tmp_path):
    world2.run(_check_training_follows_unsharded, 6, str(tmp_path))


def _check_hf_load_into_shards(directory: str, tie_word_embeddings: bool) -> None:
    groups = init_parallel_groups(dist.get_world_size())
    loaded = load_sharded_hf_checkpoint(directory, groups, gdn_backend="torch")
    expected = shard_model(QwenHybridForCausalLM.from_pretrained(directory, gdn_backend="torch"), groups)
    assert loaded.config.tie_word_embeddings == tie_word_embeddings
    if tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    loaded_state, expected_state = loaded.state_dict(), expected.state_dict()
    assert loaded_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(loaded_state[name], tensor), name
    input_ids, cu_seqlens, labels = _packed_batch(loaded.config, seed=4)
    loaded_loss = loaded(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss
    expected_loss = expected(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss
    assert torch.equal(loaded_loss, expected_loss)


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_hf_checkpoint_loads_into_shards_like_load_then_shard(world2, tmp_path, tie_word_embeddings):
    model = _random_model(_tiny_config(tie_word_embeddings=tie_word_embeddings))
    model.save_pretrained(tmp_path)
    world2.run(_check_hf_load_into_shards, str(tmp_path), tie_word_embeddings)


def _check_sequence_parallel_needs_tokens_divisible_by_tp() -> None:
    groups = init_parallel_groups(dist.get_world_size())
    config = _tiny_config()
    model = shard_model(_random_model(config), groups, sequence_parallel=True)
    input_ids, cu_seqlens, labels = _packed_batch(config, seed=1, num_tokens=41)
    with pytest.raises(ValueError, match="the token count must be a multiple of tp"):
        model(input_ids, cu_seqlens=cu_seqlens, labels=labels)


def test_sequence_parallel_rejects_token_count_not_divisible_by_tp(world2):
    world2.run(_check_sequence_parallel_needs_tokens_divisible_by_tp)


def _check_groups_layout() -> None:
    groups = init_parallel_groups(2)
    rank = dist.get_rank()
    assert (groups.tp_size, groups.dp_size) == (2, 2)
    assert (groups.tp_rank, groups.dp_rank) == (rank % 2, rank // 2)
    for group, ranks in ((groups.tp_group, groups.tp_ranks), (groups.dp_group, groups.dp_ranks)):
        members = [torch.zeros((), dtype=torch.long) for _ in range(2)]
        dist.all_gather(members, torch.tensor(rank), group=group)
        assert [int(m) for m in members] == ranks
    assert groups.tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    # DeepSpeed reads the data-parallel group and the tensor-parallel size through mpu
    import deepspeed
    from deepspeed.utils import groups as deepspeed_groups

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group already up
    deepspeed_groups.mpu = groups
    try:
        assert deepspeed_groups._get_data_parallel_group() is groups.dp_group
        assert deepspeed_groups._get_data_parallel_world_size() == 2
        assert deepspeed_groups._get_model_parallel_world_size() == 2
        assert deepspeed_groups._get_broadcast_src_rank() == rank % 2
    finally:
        deepspeed_groups.mpu = None


def test_groups_form_a_dp_by_tp_grid_that_deepspeed_reads(world4):
    world4.run(_check_groups_layout)


def _check_vocab_parallel_cross_entropy() -> None:
    groups = init_parallel_groups(dist.get_world_size())
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(23, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(12, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 12, (23,), generator=generator)
    labels[[0, 7]] = -100
    expected = chunked_cross_entropy(hidden, weight, labels, chunk_size=5)
    expected.backward()
    rows = 12 // groups.tp_size
    start = groups.tp_rank * rows
    local_hidden = hidden.detach().clone().requires_grad_()
    local_weight = weight.detach()[start:start + rows].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local_hidden, local_weight, labels, start, groups.tp_group, chunk_size=5)
    got.backward()
    assert relative_error(got, expected) <= 1e-12
    assert relative_error(local_hidden.grad, hidden.grad) <= 1e-12
    assert relative_error(local_weight.grad, weight.grad[start:start + rows]) <= 1e-12


def test_vocab_parallel_cross_entropy_matches_chunked_cross_entropy(world2):
    world2.run(_check_vocab_parallel_cross_entropy)


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (dict(), 4, "model.layers.0.linear_attn: linear_num_key_heads = 2 does not divide by tp = 4"),
        (dict(linear_num_key_heads=3, linear_num_value_heads=6, num_attention_heads=6, num_key_value_heads=3), 2,
         "model.layers.0.linear_attn: linear_num_key_heads = 3 does not divide by tp = 2"),
        (dict(linear_num_key_heads=4, linear_num_value_heads=4, num_attention_heads=6, num_key_value_heads=2), 4,
         "model.layers.1.self_attn: num_attention_heads = 6 does not divide by tp = 4"),
        (dict(linear_num_key_heads=4, linear_num_value_heads=4, num_attention_heads=12, num_key_value_heads=3), 4,
         "model.layers.1.self_attn: num_key_value_heads = 3 and tp = 4"),
        (dict(intermediate_size=100, linear_num_key_heads=8, linear_num_value_heads=8, num_attention_heads=8,
              num_key_value_heads=2), 8, "model.layers.0.mlp: intermediate_size = 100 does not divide by tp = 8"),
        (dict(vocab_size=511), 2, "model.embed_tokens / lm_head: vocab_size = 511 does not divide by tp = 2"),
    ],
)
def test_plan_names_the_layer_and_counts_that_do_not_split(overrides, tp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_tensor_parallel(_tiny_config(**overrides), tp, 0)


@pytest.mark.parametrize("size", ["0.8B", "2B", "4B", "9B", "27B"])
def test_every_qwen3_5_size_splits_over_1_2_4_and_8_ranks(size):
    config = QwenHybridConfig.named(size)
    for tp in (1, 2, 4, 8):
        plan = plan_tensor_parallel(config, tp, tp - 1)
        gdn = plan.local_heads["model.layers.0.linear_attn"]
        assert gdn["num_k_heads"] * tp == config.linear_num_key_heads
        assert gdn["num_v_heads"] * tp == config.linear_num_value_heads
        attention = plan.local_heads["model.layers.3.self_attn"]
        assert attention["num_heads"] * tp == config.num_attention_heads
        assert attention["num_kv_heads"] * min(tp, config.num_key_value_heads) == config.num_key_value_heads


def test_plan_accepts_kv_heads_that_divide_tp():
    config = _tiny_config(linear_num_key_heads=6, linear_num_value_heads=6, num_attention_heads=6,
                          num_key_value_heads=3, intermediate_size=120, vocab_size=516)
    plan = plan_tensor_parallel(config, 6, 5)
    assert plan.local_heads["model.layers.1.self_attn"] == {"num_heads": 1, "num_kv_heads": 1}
    kv_shard = plan.shards["model.layers.1.self_attn.k_proj.weight"]
    assert (kv_shard.copies, kv_shard.first_copy, kv_shard.pieces) == (2, False, ((64, 96),))


def test_shards_of_every_rank_tile_each_parameter_exactly_once():
    """Unique shards partition the full tensor; replicated KV slices are counted once in the norm."""
    config = QwenHybridConfig.named("9B")
    tp = 8
    plans = [plan_tensor_parallel(config, tp, r) for r in range(tp)]
    for name, shard in plans[0].shards.items():
        covered = torch.zeros(shard.full_size, dtype=torch.long)
        first_copies = torch.zeros(shard.full_size, dtype=torch.long)
        for plan in plans:
            rank_shard = plan.shards[name]
            for start, end in rank_shard.pieces:
                covered[start:end] += 1
                first_copies[start:end] += int(rank_shard.first_copy)
        assert torch.all(covered == shard.copies), name
        assert torch.all(first_copies == 1), name
    assert plans[0].local_heads["model.layers.0.linear_attn"] == {"num_k_heads": 2, "num_v_heads": 4}
    assert plans[0].local_heads["model.layers.3.self_attn"] == {"num_heads": 2, "num_kv_heads": 1}


def _assert_engine_follows_reference_step(engine, loss, reference, reference_optimizer, batches, dp_rank, step):
    """One optimizer step of the unsharded reference on the mean loss of every replica's batch; the
    engine's loss on this replica and its global gradient norm must match it."""
    reference_losses = [reference(ids, cu_seqlens=cu, labels=lab).loss for ids, cu, lab in batches]
    torch.stack(reference_losses).mean().backward()
    reference_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    reference_optimizer.step()
    reference_optimizer.zero_grad()

    expected_loss = reference_losses[dp_rank]
    assert relative_error(loss.detach(), expected_loss.detach()) <= 1e-5, (step, loss.item(), expected_loss.item())
    grad_norm = torch.tensor(float(engine.get_global_grad_norm()))
    assert relative_error(grad_norm, reference_norm) <= 1e-4, (step, grad_norm.item(), reference_norm.item())


def _check_deepspeed_zero_over_data_parallel_group(
    zero_stage: int, sequence_parallel: bool, num_steps: int, directory: str
) -> None:
    """tp = 2 x dp = 2 under DeepSpeed ZeRO with `mpu=groups` follows the unsharded model trained on
    the mean loss of both data-parallel batches; DeepSpeed's gradient norm counts each shard once;
    its checkpoint (one file set per tp rank) resumes the same run."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the CPU allreduce
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    groups = init_parallel_groups(2)
    config = _tiny_config()
    reference = _random_model(config, seed=6)
    model = shard_model(copy.deepcopy(reference), groups, sequence_parallel=sequence_parallel)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1e6,  # never clips, but makes DeepSpeed compute the global norm
    }

    def make_engine(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=groups)[0]

    engine = make_engine(model)
    assert engine.dp_world_size == 2
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(num_steps):
        batches = [_packed_batch(config, seed=100 * step + dp) for dp in range(groups.dp_size)]
        input_ids, cu_seqlens, labels = batches[groups.dp_rank]
        loss = engine(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss
        engine.backward(loss)
        engine.step()
        _assert_engine_follows_reference_step(engine, loss, reference, reference_optimizer, batches, groups.dp_rank, step)

    engine.save_checkpoint(directory, tag="resume")
    resumed = make_engine(shard_model(_random_model(config, seed=99), groups, sequence_parallel=sequence_parallel))
    resumed.load_checkpoint(directory, tag="resume")
    input_ids, cu_seqlens, labels = _packed_batch(config, seed=1000 + groups.dp_rank)
    losses = []
    for run in (engine, resumed):  # one more step each (weights and optimizer state), then a forward
        run.backward(run(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss)
        run.step()
        losses.append(run(input_ids, cu_seqlens=cu_seqlens, labels=labels).loss.detach())
    assert torch.equal(losses[0], losses[1]), [loss.item() for loss in losses]


@pytest.mark.parametrize("zero_stage, sequence_parallel", [(1, False), (2, False), (3, False), (2, True)])
def test_deepspeed_zero_with_tp2_dp2_follows_unsharded_and_resumes(world4, tmp_path, zero_stage, sequence_parallel):
    world4.run(_check_deepspeed_zero_over_data_parallel_group, zero_stage, sequence_parallel, 3, str(tmp_path))


def _check_matches_unsharded_on_device(device_type: str, num_tokens: int, config_overrides: dict) -> None:
    """A 0.8B-shaped slice (one GDN and one attention layer, by default the real 248k vocabulary,
    packed documents) on one device a rank, in float64, float32 (TF32 off) and bf16, without and
    with sequence parallelism."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    groups = init_parallel_groups(2)
    config = QwenHybridConfig.named(
        "0.8B", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], gdn_backend="torch",
        **config_overrides,
    )
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, config.vocab_size, (1, num_tokens), generator=generator).to(device)
    cu_seqlens = torch.tensor([0, num_tokens // 4, num_tokens * 5 // 8, num_tokens], dtype=torch.int32, device=device)

    def make_reference(dtype):
        torch.manual_seed(0)
        with torch.device(device):
            return QwenHybridForCausalLM(config).to(dtype)

    for sequence_parallel in (False, True):
        _check_sharded_runs(
            make_reference, (input_ids, cu_seqlens, input_ids), None, groups,
            (torch.float64, torch.float32, torch.bfloat16), sequence_parallel=sequence_parallel,
        )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_two_gpus_over_nccl_matches_unsharded():
    world = _ProcessWorld(2, backend="nccl", timeout_s=540.0)
    try:
        world.run(_check_matches_unsharded_on_device, "cuda", 4096, {})
    finally:
        world.close()
