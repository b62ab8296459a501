"""Tensor and context parallelism for `QwenHybridForCausalLM`, applied from outside the model.

    groups = init_parallel_groups(tp, cp)             # after torch.distributed / DeepSpeed init
    model = shard_model(QwenHybridForCausalLM(config).to(device), groups, sequence_parallel=True)
    # or: model = load_sharded_hf_checkpoint(path, groups, dtype=torch.bfloat16, device=device,
    #                                        sequence_parallel=True)
    model = apply_context_parallel(model, groups)     # after the tp sharding; cp = 1: no-op
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=groups)   # ZeRO over dp x cp
    part = context_parallel_slice(input_ids, cu_seqlens, labels, cp_size=groups.cp_size, cp_rank=groups.cp_rank)
    loss = engine(**part.model_inputs()).loss
    save_hf_checkpoint(engine.module, groups, out_dir)                  # gathers the shards

Every rank of a tensor-parallel group must see the same batch, and every rank of a
context-parallel group the same batch too (each takes its slice): shard the data by
`groups.dp_rank` of `groups.dp_size`. With sequence parallelism the tokens of a micro-batch must
divide by tp (by tp x cp with context parallelism).
"""
from qwen_hybrid.parallel.checkpoint import load_sharded_hf_checkpoint, save_hf_checkpoint
from qwen_hybrid.parallel.context import (
    ContextParallelPlan,
    SequenceSlice,
    apply_context_parallel,
    context_parallel_slice,
    plan_context_parallel,
)
from qwen_hybrid.parallel.groups import ParallelGroups, init_parallel_groups
from qwen_hybrid.parallel.sharding import (
    ModulePlan,
    TensorParallelPlan,
    gather_full_state_dict,
    plan_tensor_parallel,
    shard_model,
)

__all__ = [
    "ContextParallelPlan",
    "ModulePlan",
    "ParallelGroups",
    "SequenceSlice",
    "TensorParallelPlan",
    "apply_context_parallel",
    "context_parallel_slice",
    "gather_full_state_dict",
    "init_parallel_groups",
    "load_sharded_hf_checkpoint",
    "plan_context_parallel",
    "plan_tensor_parallel",
    "save_hf_checkpoint",
    "shard_model",
]
