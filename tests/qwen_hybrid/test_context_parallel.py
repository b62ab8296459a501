"""Context parallelism (qwen_hybrid/parallel/context.py) against the unsharded model: on CPU over
gloo in float64 (2 and 4 processes), and on one GPU with the TileLang op in bf16 (marked gpu).

Every rank builds the same model, keeps an unsharded copy as the reference, runs it on the whole
packed sequence and its context-parallel copy on its slice, then compares the loss, the logits
(gathered over the cp group) and every parameter gradient (averaged over the cp group, the
contract of the loss; the logits probe term is scaled by cp to follow it). The process machinery is the tensor-parallel tests'.
Run with `python -m pytest tests/qwen_hybrid/test_context_parallel.py -s` (-s prints the worst
error per parameter).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re

import pytest
import torch
import torch.distributed as dist

from flashqla.testing import relative_error
from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from qwen_hybrid.layers import DocumentLayout
from qwen_hybrid.model import shift_labels
from qwen_hybrid.parallel.collectives import all_reduce_staged
from qwen_hybrid.parallel import (
    apply_context_parallel,
    context_parallel_slice,
    init_parallel_groups,
    plan_context_parallel,
    shard_model,
)
from test_tensor_parallel import _assert_engine_follows_reference_step, _ProcessWorld, _random_model, _tiny_config

TOLERANCE = 1e-9
NUM_TOKENS = 96
# cp = 4 (and tp = 2 x cp = 2) needs 4 GDN key heads; attention's 2 KV heads are then repeated
FOUR_KEY_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)
# Slice boundaries: cp = 2 at 48; cp = 4 at 24, 48, 72.
LAYOUTS = {
    # every boundary inside a document; [10, 60) spans three slices at cp = 4; a one-token
    # document at 60 and an empty one at 61
    "crossing": [0, 10, 60, 61, 61, 82, 96],
    # documents start exactly at 24 (after an empty one, with a one-token one) and at 48
    "aligned": [0, 24, 24, 25, 48, 80, 96],
}


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


def _batch(config: QwenHybridConfig, seed: int):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (1, NUM_TOKENS), generator=generator)
    labels = input_ids.clone()
    labels[0, 5:8] = -100
    labels[0, 46:50] = -100  # ignored targets on both sides of the middle boundary
    probe = torch.randn(1, NUM_TOKENS, config.vocab_size, generator=generator, dtype=torch.float64)
    return input_ids, labels, probe


def _restart_gdn_state_at_each_slice(model: QwenHybridForCausalLM, cp_size: int, cp_rank: int) -> None:
    """A wrong implementation: each rank runs its GDN layers on its slice alone, as though a
    document started there (the recurrent state and the conv restart at the slice start)."""
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            layer.linear_attn.head_exchange = None
            layer.linear_attn.register_forward_pre_hook(
                functools.partial(_offsets_within_slice, cp_size=cp_size, cp_rank=cp_rank)
            )


def _offsets_within_slice(module, args, cp_size, cp_rank):
    x, documents = args
    length = x.shape[1]
    local = (documents.cu_seqlens_cpu.long() - cp_rank * length).clamp(0, length)
    return x, DocumentLayout.build(local, x.device)


def _check_matches_unsharded(
    tp: int, cp: int, overrides: dict, activation_checkpointing: bool | str, sequence_parallel: bool, out_dir: str,
    restart_gdn_at_slices: bool = False,
) -> None:
    """Loss, gathered logits and every gradient (averaged over cp) against the unsharded model on
    each of LAYOUTS, float64. Writes the worst error per name to out_dir/errors_<rank>.json and
    asserts <= TOLERANCE unless `restart_gdn_at_slices` (the wrong implementation) is on."""
    groups = init_parallel_groups(tp, cp)
    assert (groups.tp_size, groups.cp_size, groups.dp_size) == (tp, cp, 1)
    config = _tiny_config(**overrides)
    reference = _random_model(config).to(torch.float64)
    model = copy.deepcopy(reference)
    shard_model(model, groups, sequence_parallel=sequence_parallel)
    apply_context_parallel(model, groups)
    # True: whole layers recomputed; "keep_attention": attention layers keep the kernel's tensors
    model.set_activation_checkpointing(bool(activation_checkpointing),
                                       recompute_attention=activation_checkpointing != "keep_attention")
    if restart_gdn_at_slices:
        _restart_gdn_state_at_each_slice(model, cp, groups.cp_rank)
    tp_plan = model.tensor_parallel_plan
    reference_parameters = dict(reference.named_parameters())
    worst: dict[str, float] = {}

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        worst[name] = max(worst.get(name, 0.0), relative_error(got, want))

    for seed, (layout, bounds) in enumerate(LAYOUTS.items()):
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        input_ids, labels, probe = _batch(config, seed)
        expected = reference(input_ids, cu_seqlens=cu_seqlens, labels=labels, return_logits=True)
        (expected.loss + (expected.logits * probe).sum()).backward()

        part = context_parallel_slice(input_ids, cu_seqlens, labels, cp_size=cp, cp_rank=groups.cp_rank)
        local_length = NUM_TOKENS // cp
        window = slice(groups.cp_rank * local_length, (groups.cp_rank + 1) * local_length)
        got = model(**part.model_inputs(), return_logits=True)
        # per-token terms carry cp, like the loss's gradient (the mean over ranks is the objective's)
        (got.loss + cp * (got.logits * probe[:, window]).sum()).backward()

        record("loss", got.loss.detach(), expected.loss.detach())
        pieces = [torch.empty_like(got.logits) for _ in range(cp)]
        dist.all_gather(pieces, got.logits.detach().contiguous(), group=groups.cp_group)
        record("logits", torch.cat(pieces, dim=1), expected.logits.detach())
        for name, parameter in model.named_parameters():
            grad = parameter.grad.clone()
            dist.all_reduce(grad, group=groups.cp_group)
            grad /= cp
            want = reference_parameters[name].grad
            shard = tp_plan.shards.get(name) if tp_plan is not None else None
            record(f"grad {name}", grad, shard.take(want) if shard is not None else want)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)

    with open(os.path.join(out_dir, f"errors_{dist.get_rank()}.json"), "w") as file:
        json.dump(worst, file)
    if not restart_gdn_at_slices:
        failed = {name: error for name, error in worst.items() if not error <= TOLERANCE}
        assert not failed, f"rank {dist.get_rank()}: off the unsharded model by more than {TOLERANCE:.0e}: {failed}"


def _worst_over_ranks(out_dir, world_size: int) -> dict[str, float]:
    worst: dict[str, float] = {}
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"errors_{rank}.json")) as file:
            for name, error in json.load(file).items():
                worst[name] = max(worst.get(name, 0.0), error)
    return worst


def _report(title: str, worst: dict[str, float]) -> None:
    print(f"\n{title}: worst relative error per tensor over ranks and layouts")
    for name, error in worst.items():
        print(f"  {error:9.2e}  {name}")


@pytest.mark.parametrize(
    "tp, cp, overrides, activation_checkpointing, sequence_parallel",
    [
        (1, 2, {}, False, False),
        (1, 2, {}, True, False),
        (1, 4, FOUR_KEY_HEADS, True, False),
        (2, 2, FOUR_KEY_HEADS, False, False),
        (2, 2, FOUR_KEY_HEADS, "keep_attention", True),
    ],
    ids=["cp2", "cp2-checkpointed", "cp4-repeated-kv-checkpointed", "tp2-cp2",
         "tp2-cp2-sequence-parallel-checkpointed-keeping-attention"],
)
def test_context_parallel_matches_unsharded(
    request, tmp_path, tp, cp, overrides, activation_checkpointing, sequence_parallel
):
    world = request.getfixturevalue("world2" if tp * cp == 2 else "world4")  # start only the one needed
    world.run(_check_matches_unsharded, tp, cp, overrides, activation_checkpointing, sequence_parallel, str(tmp_path))
    worst = _worst_over_ranks(tmp_path, tp * cp)
    _report(f"tp = {tp}, cp = {cp}{', sequence parallel' if sequence_parallel else ''}"
            f"{', checkpointed' if activation_checkpointing else ''}", worst)
    assert max(worst.values()) <= TOLERANCE


def test_restarting_the_gdn_state_at_each_slice_fails_the_check(world2, tmp_path):
    """The criterion above can see the error context parallelism exists to avoid."""
    world2.run(_check_matches_unsharded, 1, 2, {}, False, False, str(tmp_path), True)
    worst = _worst_over_ranks(tmp_path, 2)
    _report("wrong implementation (GDN state restarted at each slice)", {
        name: error for name, error in worst.items() if error > TOLERANCE
    })
    assert worst["loss"] > 1e-4 and worst["logits"] > 1e-3, worst
    assert worst["grad model.layers.0.linear_attn.A_log"] > 1e-3, worst


def test_slices_concatenate_to_the_shifted_batch():
    config = _tiny_config()
    input_ids, labels, _ = _batch(config, seed=0)
    for bounds in LAYOUTS.values():
        cu_seqlens = torch.tensor(bounds)
        for cp in (1, 2, 4):
            parts = [context_parallel_slice(input_ids, cu_seqlens, labels, cp_size=cp, cp_rank=r) for r in range(cp)]
            assert torch.equal(torch.cat([p.input_ids for p in parts], 1), input_ids)
            assert torch.equal(torch.cat([p.targets for p in parts], 1), shift_labels(labels, cu_seqlens))
            assert all(p.cu_seqlens is cu_seqlens for p in parts)
            assert parts[0].num_targets == int((shift_labels(labels, cu_seqlens) != -100).sum())
            positions = torch.cat([p.position_ids for p in parts], 1)[0].tolist()
            starts = [start for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
            assert [t for t, position in enumerate(positions) if position == 0] == starts
    # the last token of slice 0 (of 2) predicts the first of slice 1 inside document [10, 60)
    part = context_parallel_slice(input_ids, torch.tensor(LAYOUTS["crossing"]), cp_size=2, cp_rank=0)
    assert part.targets[0, -1] == input_ids[0, 48]
    # ... but not across a document end: 47 is the last token before the document starting at 48
    part = context_parallel_slice(input_ids, torch.tensor(LAYOUTS["aligned"]), cp_size=2, cp_rank=0)
    assert part.targets[0, -1] == -100


def test_slice_refuses_tokens_not_divisible_by_cp():
    with pytest.raises(ValueError, match=re.escape("input_ids has T = 10 tokens, which cp_size = 4 does not divide")):
        context_parallel_slice(torch.zeros(1, 10, dtype=torch.long), cp_size=4, cp_rank=0)
    with pytest.raises(ValueError, match=re.escape("cp_rank must be in [0, 2), got 2")):
        context_parallel_slice(torch.zeros(1, 10, dtype=torch.long), cp_size=2, cp_rank=2)


@pytest.mark.parametrize(
    "overrides, tp, cp, message",
    [
        (dict(), 1, 4, "model.layers.0.linear_attn: 2 key heads a tensor-parallel rank (linear_num_key_heads = 2, "
                       "tp = 1) do not divide by cp = 4"),
        (FOUR_KEY_HEADS, 2, 4, "model.layers.0.linear_attn: 2 key heads a tensor-parallel rank "
                               "(linear_num_key_heads = 4, tp = 2) do not divide by cp = 4"),
        (dict(linear_num_key_heads=4, linear_num_value_heads=4, num_attention_heads=6, num_key_value_heads=2), 1, 4,
         "model.layers.1.self_attn: 6 query heads a tensor-parallel rank (num_attention_heads = 6, tp = 1) do not "
         "divide by cp = 4"),
        (dict(linear_num_key_heads=4, linear_num_value_heads=4, num_attention_heads=12, num_key_value_heads=3), 1, 4,
         "model.layers.1.self_attn: 3 KV heads a tensor-parallel rank (num_key_value_heads = 3, tp = 1) and cp = 4"),
    ],
)
def test_plan_names_the_layer_and_counts_that_do_not_split(overrides, tp, cp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_context_parallel(_tiny_config(**overrides), cp, 0, tp)


@pytest.mark.parametrize("size, tp, cp", [("0.8B", 1, 8), ("0.8B", 2, 4), ("2B", 1, 8), ("4B", 2, 8), ("9B", 4, 4)])
def test_qwen3_5_sizes_split_over_tp_and_cp(size, tp, cp):
    plan = plan_context_parallel(QwenHybridConfig.named(size), cp, cp - 1, tp)
    config = QwenHybridConfig.named(size)
    assert plan.mixers["model.layers.0.linear_attn"]["num_k_heads"] * tp * cp == config.linear_num_key_heads
    assert plan.mixers["model.layers.3.self_attn"]["num_heads"] * tp * cp == config.num_attention_heads


def test_model_refuses_unshifted_labels_and_missing_positions_on_a_slice():
    model = _random_model(_tiny_config())
    model.model.sequence_shards = 2  # as apply_context_parallel leaves it (no collective is reached)
    input_ids = torch.zeros(1, 8, dtype=torch.long)
    cu_seqlens = torch.tensor([0, 16])
    with pytest.raises(ValueError, match="labels: this model sees one of 2 slices"):
        model(input_ids, cu_seqlens=cu_seqlens, position_ids=torch.zeros_like(input_ids), labels=input_ids)
    with pytest.raises(ValueError, match="position_ids: none given"):
        model(input_ids, cu_seqlens=cu_seqlens, targets=input_ids)
    with pytest.raises(ValueError, match=re.escape("end at the whole sequence's 2 x T = 16")):
        model(input_ids, cu_seqlens=torch.tensor([0, 8]), position_ids=torch.zeros_like(input_ids), targets=input_ids)


def _check_groups_layout() -> None:
    """world 8 would be the real thing; world 4 = dp 1 x cp 2 x tp 2 checks the grid and DeepSpeed's view."""
    groups = init_parallel_groups(2, 2)
    rank = dist.get_rank()
    assert (groups.tp_rank, groups.cp_rank, groups.dp_rank) == (rank % 2, rank // 2, 0)
    for group, ranks in ((groups.tp_group, groups.tp_ranks), (groups.cp_group, groups.cp_ranks),
                         (groups.dp_cp_group, groups.dp_cp_ranks)):
        members = [torch.zeros((), dtype=torch.long) for _ in range(len(ranks))]
        dist.all_gather(members, torch.tensor(rank), group=group)
        assert [int(m) for m in members] == ranks
    assert groups.cp_ranks == [rank % 2, rank % 2 + 2]
    assert dist.get_rank(groups.cp_group) == groups.cp_rank
    import deepspeed
    from deepspeed.utils import groups as deepspeed_groups

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group already up
    deepspeed_groups.mpu = groups
    try:
        assert deepspeed_groups._get_data_parallel_group() is groups.dp_cp_group
        assert deepspeed_groups._get_data_parallel_world_size() == 2
        assert deepspeed_groups._get_sequence_data_parallel_group() is groups.dp_cp_group
        assert deepspeed_groups._get_sequence_parallel_world_size() == 1  # DeepSpeed's Ulysses stays off
        assert deepspeed_groups._get_model_parallel_world_size() == 2
    finally:
        deepspeed_groups.mpu = None


def test_groups_form_a_dp_cp_tp_grid_that_deepspeed_reads(world4):
    world4.run(_check_groups_layout)


def _check_deepspeed_averages_over_dp_and_cp(zero_stage: int, num_steps: int) -> None:
    """dp = 2 x cp = 2 under DeepSpeed ZeRO with `mpu=groups` follows the unsharded model trained
    on the mean loss of both data-parallel batches, and its gradient norm equals the unsharded one."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the CPU allreduce
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    groups = init_parallel_groups(1, 2)
    config = _tiny_config()
    reference = _random_model(config, seed=6)
    model = apply_context_parallel(copy.deepcopy(reference), groups)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1e6,  # never clips, but makes DeepSpeed compute the global norm
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=groups)[0]
    assert engine.dp_world_size == 4 and engine.sequence_parallel_size == 1
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(num_steps):
        batches = []
        for dp in range(groups.dp_size):
            input_ids, labels, _ = _batch(config, seed=100 * step + dp)
            batches.append((input_ids, torch.tensor(LAYOUTS["crossing" if dp == 0 else "aligned"]), labels))
        input_ids, cu_seqlens, labels = batches[groups.dp_rank]
        part = context_parallel_slice(input_ids, cu_seqlens, labels, cp_size=2, cp_rank=groups.cp_rank)
        loss = engine(**part.model_inputs()).loss
        engine.backward(loss)
        engine.step()
        _assert_engine_follows_reference_step(engine, loss, reference, reference_optimizer, batches, groups.dp_rank, step)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_deepspeed_zero_with_cp2_dp2_follows_unsharded(world4, zero_stage):
    world4.run(_check_deepspeed_averages_over_dp_and_cp, zero_stage, 3)


def _check_bf16_on_one_device(out_dir: str, device_type: str, num_tokens: int, overrides: dict) -> None:
    """cp = 2 with both ranks on one device (on a GPU: two processes over gloo, staged through
    host memory, since NCCL cannot put two ranks on one GPU): a 0.8B-shaped slice (one GDN and one
    attention layer) in bf16 with the op's default backend (TileLang on an H200), against the
    unsharded bf16 model and the unsharded float64 one (torch op). Passes where the cp model is no
    further from float64 than 2x the unsharded bf16 model is (a gradient's error taken no lower than the
    median of the gradients'), + 1e-3. Writes the errors to out_dir/bf16_errors_<rank>.json."""
    device = torch.device("cuda") if device_type == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    groups = init_parallel_groups(1, 2)
    config_values = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **overrides)
    bounds = [0, num_tokens // 8, num_tokens * 5 // 8, num_tokens * 5 // 8 + 1, num_tokens * 5 // 8 + 1, num_tokens]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)  # [1/8, 5/8) crosses the boundary
    vocab_size = QwenHybridConfig.named("0.8B", **config_values).vocab_size
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, vocab_size, (1, num_tokens), generator=generator).to(device)
    part = context_parallel_slice(input_ids, cu_seqlens, cp_size=2, cp_rank=groups.cp_rank)

    def build(dtype, backend):
        torch.manual_seed(0)
        config = QwenHybridConfig.named("0.8B", gdn_backend=backend, **config_values)
        with torch.device(device):
            return QwenHybridForCausalLM(config).to(dtype)

    def outputs(model, out):
        named = {"loss": out.loss.detach()}
        for name, parameter in model.named_parameters():
            named[f"grad {name}"] = parameter.grad
        return named

    truth_model = build(torch.float64, "torch")
    truth_out = truth_model(input_ids, cu_seqlens=cu_seqlens, labels=input_ids)
    truth_out.loss.backward()
    truth = outputs(truth_model, truth_out)
    del truth_model, truth_out
    reference = build(torch.bfloat16, "auto")
    out = reference(input_ids, cu_seqlens=cu_seqlens, labels=input_ids)
    out.loss.backward()
    unsharded = outputs(reference, out)
    model = apply_context_parallel(copy.deepcopy(reference), groups)
    model.zero_grad(set_to_none=True)
    sharded_out = model(**part.model_inputs())
    sharded_out.loss.backward()
    sharded = outputs(model, sharded_out)
    floors = {name: float(relative_error(unsharded[name], truth[name])) for name in sharded}
    # a small tensor's own bf16 error is luck (A_log, 4 values on the CPU: 2.4e-3 where the other gradients have
    # ~2e-2), so no tensor's floor is taken below the median over the gradients
    noise = float(torch.tensor([error for name, error in floors.items() if name.startswith("grad ")]).median())
    report, failures = {}, []
    for name, value in sharded.items():
        if name.startswith("grad "):
            # the mean over cp is the unsharded gradient; gloo on CUDA tensors goes through the host
            value = all_reduce_staged(value.float(), groups.cp_group) / 2
        floor = floors[name] if name == "loss" else max(floors[name], noise)
        from_truth = relative_error(value, truth[name])
        report[name] = {"unsharded_bf16_vs_float64": floors[name], "cp2_bf16_vs_float64": from_truth,
                        "cp2_vs_unsharded_bf16": relative_error(value, unsharded[name])}
        if not from_truth <= 2 * floor + 1e-3:  # also catches NaN
            failures.append(f"{name}: {from_truth:.2e} from float64, the unsharded bf16 model {floors[name]:.2e}"
                            f" (floor {floor:.2e})")
    with open(os.path.join(out_dir, f"bf16_errors_{dist.get_rank()}.json"), "w") as file:
        json.dump(report, file, indent=1)
    assert not failures, failures


def _print_bf16_report(out_dir) -> None:
    with open(os.path.join(out_dir, "bf16_errors_0.json")) as file:
        report = json.load(file)
    print("\ncp = 2 in bf16 against float64 (relative errors)")
    for name, errors in report.items():
        print(f"  {name}: " + ", ".join(f"{key} {value:.2e}" for key, value in errors.items()))


def test_cp2_bf16_on_cpu_follows_the_unsharded_bf16_model(world2, tmp_path):
    """The GPU test's check on the CPU, small (torch op, a 512-token vocabulary), so that its code
    runs in CI; the GPU test below is the one that measures."""
    world2.run(_check_bf16_on_one_device, str(tmp_path), "cpu", 256, dict(vocab_size=512, hidden_size=256,
               intermediate_size=512, linear_num_key_heads=4, linear_num_value_heads=4))
    _print_bf16_report(tmp_path)


@pytest.mark.gpu
def test_cp2_bf16_tilelang_on_one_gpu_matches_unsharded(tmp_path):
    # both ranks peak near 30 GiB (the float64 truth): on an 80 GB H100 they fit only if this process gives back
    # what earlier tests left cached (17 GiB ran them out of memory; forty-third session)
    torch.cuda.empty_cache()
    world = _ProcessWorld(2, backend="gloo", timeout_s=540.0)
    try:
        world.run(_check_bf16_on_one_device, str(tmp_path), "cuda", 8192, {})
    finally:
        world.close()
    _print_bf16_report(tmp_path)
