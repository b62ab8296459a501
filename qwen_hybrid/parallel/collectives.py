"""The tensor-parallel collectives as autograd functions.

A head-sharded block reads the full (replicated) hidden state and writes a partial sum of its
output: `copy_to_tensor_parallel` on its input (identity forward, all-reduce of the input
gradient backward) and `reduce_from_tensor_parallel` on its output (all-reduce forward, identity
backward) make both the values and every gradient equal those of the unsharded block.

With sequence parallelism the hidden state between blocks is split by tokens (dim 1 of
[B, T, H]) instead of replicated: `gather_tokens` (all-gather forward, reduce-scatter backward)
and `reduce_scatter_tokens` (the reverse) take the places of the two above, moving the same bytes
while each rank keeps only T/tp tokens of the residual stream and its norms.
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
        if not x.is_contiguous():
            return _all_reduce(x, group)
        # in place: x is a projection's fresh output; were it saved for backward, autograd's
        # version check would raise instead of computing with the reduced values
        dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

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


def _token_chunk(x: torch.Tensor, size: int) -> int:
    if x.shape[1] % size != 0:
        raise ValueError(
            f"sequence parallelism splits the {x.shape[1]} tokens of a {tuple(x.shape)} hidden state over "
            f"{size} ranks: the token count must be a multiple of tp"
        )
    return x.shape[1] // size


def _all_gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    tokens_first = x.transpose(0, 1).contiguous()  # [T/tp, B, H]: rank chunks are contiguous
    out = tokens_first.new_empty((tokens_first.shape[0] * size, *tokens_first.shape[1:]))
    dist.all_gather_into_tensor(out, tokens_first, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    chunk = _token_chunk(x, size)
    tokens_first = x.transpose(0, 1).contiguous()  # [T, B, H]
    out = tokens_first.new_empty((chunk, *tokens_first.shape[1:]))
    dist.reduce_scatter_tensor(out, tokens_first, group=group)
    return out.transpose(0, 1)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_tokens(grad, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_tokens(grad, ctx.group), None


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T/tp, H] token slices of every rank -> [B, T, H] in rank order; backward sums the
    gradient over the group and keeps this rank's tokens."""
    if group_size(group) == 1:
        return x
    return _GatherTokens.apply(x, group)


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T, H] partial sums -> this rank's tokens [B, T/tp, H] of their sum over the group;
    backward all-gathers the gradient."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterTokens.apply(x, group)
