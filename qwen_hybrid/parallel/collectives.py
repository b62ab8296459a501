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


# Context parallelism: head all-to-all between token slices and head groups, and the loss sum.
#
# A gloo group with CUDA tensors (two ranks sharing one GPU, where NCCL cannot run) stages these
# collectives through host memory; gloo's own CUDA support does not cover all-to-all.


def _staged_through_host(group, *tensors: torch.Tensor) -> bool:
    return any(t.is_cuda for t in tensors) and dist.get_backend(group) == "gloo"


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """send [size, ...] contiguous: block j goes to rank j; returns [size, ...] whose block j came
    from rank j."""
    if _staged_through_host(group, send):
        host = send.cpu()
        received = torch.empty_like(host)
        dist.all_to_all_single(received, host, group=group)
        return received.to(send.device)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def all_reduce_staged(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over `group`, in a new tensor (through host memory for gloo and a CUDA x)."""
    if _staged_through_host(group, x):
        host = x.cpu().clone()
        dist.all_reduce(host, group=group)
        return host.to(x.device)
    return _all_reduce(x, group)


def _tokens_to_heads(parts, group) -> torch.Tensor:
    size = group_size(group)
    batch, local_length = parts[0].shape[:2]
    # per part [B, T/size, n, d] -> [size, B, T/size, (n/size) d]: block j holds head group j
    blocks = [
        part.reshape(batch, local_length, size, -1).permute(2, 0, 1, 3) for part in parts
    ]
    received = _all_to_all(torch.cat(blocks, dim=-1), group)  # block j: token slice j
    return received.permute(1, 0, 2, 3).reshape(batch, size * local_length, received.shape[-1])


def _heads_to_tokens(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    batch, length, num_heads, head_dim = x.shape
    local_length = length // size
    # [B, T, n, d] -> [size, B, T/size, n d]: block j holds token slice j
    blocks = x.reshape(batch, size, local_length, num_heads * head_dim).transpose(0, 1).contiguous()
    received = _all_to_all(blocks, group)  # block j: head group j
    return received.permute(1, 2, 0, 3).reshape(batch, local_length, size * num_heads, head_dim)


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *parts):
        ctx.group = group
        ctx.shapes = [part.shape for part in parts]
        return _tokens_to_heads(parts, group)

    @staticmethod
    def backward(ctx, grad):
        size = group_size(ctx.group)
        widths = [shape[2] // size * shape[3] for shape in ctx.shapes]
        batch, length = grad.shape[:2]
        # the inverse exchange of the packed gradient, then unpacked per part
        packed = _heads_to_tokens(grad.reshape(batch, length, 1, grad.shape[-1]), ctx.group)
        packed = packed.reshape(batch, length // size, size, -1)
        grads = []
        for shape, piece in zip(ctx.shapes, torch.split(packed, widths, dim=-1)):
            grads.append(piece.reshape(shape))
        return (None, *grads)


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        size = group_size(ctx.group)
        batch, local_length, num_heads, head_dim = grad.shape
        whole = _tokens_to_heads([grad], ctx.group)
        return whole.reshape(batch, local_length * size, num_heads // size, head_dim), None


def tokens_to_heads(parts: list[torch.Tensor], group) -> torch.Tensor:
    """Head all-to-all over `group` (size s, this rank r): parts [B, T/s, n_i, d_i], this rank's
    token slice of every head -> [B, T, sum_i (n_i/s) d_i]: head group r (heads
    [r n_i/s, (r+1) n_i/s) of each part) over the whole sequence, token slices in rank order,
    parts concatenated along the last dim. One collective for all parts; the backward is the
    inverse exchange."""
    size = group_size(group)
    if not parts:
        raise ValueError("parts must hold at least one tensor")
    batch, local_length = parts[0].shape[:2]
    for index, part in enumerate(parts):
        if part.dim() != 4 or part.shape[:2] != (batch, local_length) or part.shape[2] % size != 0:
            raise ValueError(
                f"parts[{index}] must be [B, T/size, n, d] with B, T/size = {(batch, local_length)} and n a "
                f"multiple of the group size {size}, got shape {tuple(part.shape)}"
            )
        if part.dtype != parts[0].dtype:
            raise TypeError(f"parts[{index}] is {part.dtype} but parts[0] is {parts[0].dtype}; one dtype for all")
    if size == 1:
        return torch.cat([part.reshape(batch, local_length, -1) for part in parts], dim=-1)
    return _TokensToHeads.apply(group, *parts)


def heads_to_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `tokens_to_heads` for one part: x [B, T, n, d], head group r over the whole
    sequence -> [B, T/s, s n, d], every head of this rank's token slice."""
    size = group_size(group)
    if x.dim() != 4 or x.shape[1] % size != 0:
        raise ValueError(
            f"x must be [B, T, n, d] with T a multiple of the group size {size}, got shape {tuple(x.shape)}"
        )
    if size == 1:
        return x
    return _HeadsToTokens.apply(x, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_staged(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_staged(grad, ctx.group), None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of x over `group`, differentiable: every rank's output depends on every rank's x,
    so the backward sums the output gradients of the ranks. A loss built from it and
    back-propagated on every rank gives each rank size x the gradient of its own x's share."""
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
