"""Tensor parallelism by heads for `QwenHybridForCausalLM`, applied from outside the model.

    groups = init_parallel_groups(tp)                 # after torch.distributed / DeepSpeed init
    model = shard_model(QwenHybridForCausalLM(config).to(device), groups, sequence_parallel=True)
    # or: model = load_sharded_hf_checkpoint(path, groups, dtype=torch.bfloat16, device=device,
    #                                        sequence_parallel=True)
    engine, *_ = deepspeed.initialize(model=model, ..., mpu=groups)   # ZeRO over the dp group
    save_hf_checkpoint(engine.module, groups, out_dir)                  # gathers the shards

Every rank of a tensor-parallel group must see the same batch: shard the data by
`groups.dp_rank` of `groups.dp_size`. With sequence parallelism the tokens of a micro-batch must
divide by tp.
"""
from qwen_hybrid.parallel.checkpoint import load_sharded_hf_checkpoint, save_hf_checkpoint
from qwen_hybrid.parallel.groups import ParallelGroups, init_parallel_groups
from qwen_hybrid.parallel.sharding import gather_full_state_dict, plan_tensor_parallel, shard_model

__all__ = [
    "ParallelGroups",
    "gather_full_state_dict",
    "init_parallel_groups",
    "load_sharded_hf_checkpoint",
    "plan_tensor_parallel",
    "save_hf_checkpoint",
    "shard_model",
]
