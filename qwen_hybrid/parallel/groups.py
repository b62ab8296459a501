"""Data-, context- and tensor-parallel process groups, laid out as a (dp, cp, tp) grid over the world.

Global rank = (dp_rank * cp_size + cp_rank) * tp_size + tp_rank: tensor-parallel ranks are
consecutive and context-parallel ones next, so with tp * cp <= GPUs per node both exchange over
NVLink and only data-parallel traffic crosses nodes.

Every rank of one context-parallel group holds the same parameters (and, within it, the same
tensor-parallel shard) and a different slice of the same sequence. The ranks holding identical
parameters are therefore the dp x cp ranks with one tp rank (`dp_cp_group`): their gradients are
averaged over it.

`ParallelGroups` also answers DeepSpeed's `mpu` queries (`deepspeed.initialize(..., mpu=groups)`).
DeepSpeed's "data parallel" is the ranks that hold the same parameters and partition and average
their gradients, so `get_data_parallel_*` describes dp x cp: ZeRO partitions over it and
averages gradients over it, which is what the context-parallel loss expects (each rank's
gradient is cp x its slice's share, see `qwen_hybrid.parallel.context`). `get_model_parallel_*`
and `get_tensor_model_parallel_*` describe the tp group, so the gradient norm counts each
tensor-parallel shard once. DeepSpeed's sequence-parallel queries are deliberately not answered:
with them DeepSpeed 0.19 sums over the sequence ranks in ZeRO-1/2 but averages in ZeRO-3's
reduce-scatter, so no single loss convention would hold for every stage.

DeepSpeed's data-parallel size (hence its train_batch_size = micro x accumulation x size) then
counts every cp rank; the batches themselves differ only across `dp_rank` (of `dp_size`), which
is what the data loader must shard by. With cp = 1 all of this is the dp group, as before.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    cp_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    # the ranks holding this rank's parameters (dp x cp); the dp group itself when cp = 1
    dp_cp_group: dist.ProcessGroup | None = None

    def _global_rank(self, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.cp_size + cp_rank) * self.tp_size + tp_rank

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group, in tp-rank order."""
        return [self._global_rank(self.dp_rank, self.cp_rank, t) for t in range(self.tp_size)]

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's context-parallel group, in cp-rank (= slice) order."""
        return [self._global_rank(self.dp_rank, c, self.tp_rank) for c in range(self.cp_size)]

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group, in dp-rank order."""
        return [self._global_rank(d, self.cp_rank, self.tp_rank) for d in range(self.dp_size)]

    @property
    def dp_cp_ranks(self) -> list[int]:
        """Global ranks holding the same parameters as this one, in (dp, cp) order."""
        return [self._global_rank(d, c, self.tp_rank) for d in range(self.dp_size) for c in range(self.cp_size)]

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    # DeepSpeed's mpu interface (deepspeed/utils/groups.py and bwc.py query these): its data
    # parallelism is the ranks holding identical parameters, dp x cp (module docstring).
    def get_data_parallel_group(self):
        return self.dp_cp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size * self.cp_size

    def get_data_parallel_rank(self) -> int:
        return self.dp_cp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_cp_ranks

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_ranks[0]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def _positive_integer(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def init_parallel_groups(tp: int, cp: int = 1) -> ParallelGroups:
    """Split the initialised default process group into a (dp, cp, tp) grid: tensor-parallel
    groups of `tp` consecutive ranks, context-parallel groups of `cp` ranks `tp` apart, and
    data-parallel groups of what is left (dp = world / (tp * cp)).

    Every rank must call this (collectively, once). Without an initialised process group only
    tp = cp = 1 is accepted and a single-process `ParallelGroups` (groups None) is returned.
    """
    _positive_integer("tp", tp)
    _positive_integer("cp", cp)
    if not dist.is_available() or not dist.is_initialized():
        if tp != 1 or cp != 1:
            raise RuntimeError(
                f"tp = {tp}, cp = {cp} needs torch.distributed initialised first (deepspeed.init_distributed() or "
                f"torch.distributed.init_process_group())"
            )
        return ParallelGroups(tp_group=None, dp_group=None, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % (tp * cp) != 0:
        raise ValueError(
            f"tp = {tp} x cp = {cp} = {tp * cp} must divide the world size {world_size} (world = dp x cp x tp)"
        )
    dp = world_size // (tp * cp)
    layout = ParallelGroups(
        tp_group=None, dp_group=None, tp_rank=rank % tp, tp_size=tp, dp_rank=rank // (tp * cp), dp_size=dp,
        cp_rank=rank // tp % cp, cp_size=cp,
    )
    mine = {}
    # new_group is collective over the world: every rank creates every group, in the same order
    for axis, member_lists in (
        ("tp", [[layout._global_rank(d, c, t) for t in range(tp)] for d in range(dp) for c in range(cp)]),
        ("cp", [[layout._global_rank(d, c, t) for c in range(cp)] for d in range(dp) for t in range(tp)]),
        ("dp", [[layout._global_rank(d, c, t) for d in range(dp)] for c in range(cp) for t in range(tp)]),
    ):
        for members in member_lists:
            group = dist.new_group(members)
            if rank in members:
                mine[axis] = group
    if cp == 1:
        mine["dp_cp"] = mine["dp"]
    else:
        for t in range(tp):
            members = [layout._global_rank(d, c, t) for d in range(dp) for c in range(cp)]
            group = dist.new_group(members)
            if rank in members:
                mine["dp_cp"] = group
    return dataclasses.replace(
        layout, tp_group=mine["tp"], cp_group=mine["cp"], dp_group=mine["dp"], dp_cp_group=mine["dp_cp"]
    )
