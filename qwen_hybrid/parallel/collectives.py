"""The tensor-parallel collectives as autograd functions.

A head-sharded block reads the full (replicated) hidden state and writes a partial sum of its
output: `copy_to_tensor_parallel` on its input (identity forward, all-reduce of the input
gradient backward) and `reduce_from_tensor_parallel` on its output (all-reduce forward, identity
backward) make both the values and every gradient equal those of the unsharded block.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in `group`; None stands for no parallelism (1), not for the world group."""
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # a fresh contiguous buffer: autograd may hand the same gradient tensor to several inputs
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDimFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.local_size = x.shape[-1]
        pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(group_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(-1, rank * ctx.local_size, ctx.local_size).contiguous(), None


def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over `group` backward."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over `group` forward; identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, group)


def gather_last_dim_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim in rank order; backward keeps this rank's slice."""
    if group_size(group) == 1:
        return x
    return _GatherLastDimFromTensorParallel.apply(x, group)
