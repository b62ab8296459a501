"""Tensor- and data-parallel process groups, laid out as a (dp, tp) grid over the world.

Global rank = dp_rank * tp_size + tp_rank: the ranks of one tensor-parallel group are
consecutive, so with tp <= GPUs per node they share a node (NVLink) and only data-parallel
traffic crosses nodes.

`ParallelGroups` also answers DeepSpeed's `mpu` queries (`deepspeed.initialize(..., mpu=groups)`),
so ZeRO partitions and averages over the data-parallel group only, and its gradient norm counts
each tensor-parallel shard once.
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

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group, in tp-rank order."""
        first = self.dp_rank * self.tp_size
        return list(range(first, first + self.tp_size))

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group, in dp-rank order."""
        return [dp * self.tp_size + self.tp_rank for dp in range(self.dp_size)]

    # DeepSpeed's mpu interface (deepspeed/utils/groups.py and bwc.py query these).
    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks

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


def init_parallel_groups(tp: int) -> ParallelGroups:
    """Split the initialised default process group into tensor-parallel groups of `tp` consecutive
    ranks and data-parallel groups of the ranks with the same tensor-parallel rank.

    Every rank must call this (collectively, once). Without an initialised process group only
    tp = 1 is accepted and a single-process `ParallelGroups` (groups None) is returned.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if not dist.is_available() or not dist.is_initialized():
        if tp != 1:
            raise RuntimeError(
                f"tp = {tp} needs torch.distributed initialised first (deepspeed.init_distributed() or "
                f"torch.distributed.init_process_group())"
            )
        return ParallelGroups(tp_group=None, dp_group=None, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % tp != 0:
        raise ValueError(f"tp = {tp} must divide the world size {world_size} (world = dp x tp)")
    dp = world_size // tp
    tp_group = dp_group = None
    # new_group is collective over the world: every rank creates every group, in the same order
    for dp_rank in range(dp):
        group = dist.new_group(list(range(dp_rank * tp, (dp_rank + 1) * tp)))
        if rank // tp == dp_rank:
            tp_group = group
    for tp_rank in range(tp):
        group = dist.new_group([d * tp + tp_rank for d in range(dp)])
        if rank % tp == tp_rank:
            dp_group = group
    return ParallelGroups(
        tp_group=tp_group, dp_group=dp_group, tp_rank=rank % tp, tp_size=tp, dp_rank=rank // tp, dp_size=dp
    )
