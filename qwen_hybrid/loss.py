"""Next-token cross entropy over the vocabulary in token chunks.

Only one chunk's logits (and then their gradients) exist at a time, so peak memory is
O(chunk_size x vocab) instead of O(tokens x vocab): a 100k-token sequence with Qwen3.5's 248k
vocabulary would otherwise need ~100 GB of float32 logits. With the whole vocabulary on one rank
the gradients are made in the forward, each chunk's logits computed once (three matmuls a chunk,
not four); each chunk's softmax statistics and logit gradients are one fused pass each on CUDA.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from qwen_hybrid.layers import fused

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 2048


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
    vocab_start: int = 0,
    group=None,
) -> torch.Tensor:
    """Mean cross entropy of `hidden @ weight.T` against `labels`, ignoring `ignore_index`.

    hidden: [T, H]; weight: [V, H] (the LM head); labels: [T] integer class per row (already
    shifted for next-token prediction). Returns a float32 scalar (float64 for float64 inputs);
    0 when every label is ignored (its gradient is then zero).

    Vocabulary-parallel use (qwen_hybrid.parallel): `weight` holds only the rows
    [vocab_start, vocab_start + weight.shape[0]) of the full LM head and `group` is the process
    group across which the rows are split. Ranks then exchange two floats per token (their
    log-sum-exp and target logit), never logits; each rank's hidden gradient is its partial sum,
    which the caller's collective completes.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[1]}], got shape {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T={hidden.shape[0]}], got shape {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share a dtype, got hidden {hidden.dtype}, weight {weight.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index, vocab_start, group)


def _chunk_statistics(logits, columns, label_here):
    """Per row of one chunk: log-sum-exp over these vocabulary rows, and the target logit (0 where
    the label lies in another rank's rows). float32 inside (float64 for float64 logits)."""
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    target = logits.gather(1, columns[:, None])[:, 0] * label_here
    return torch.logsumexp(logits, dim=-1), target


def _chunk_logit_grads(logits, columns, label_here, logsumexp, target_logit, row_scale):
    """d loss / d logits of one chunk, (softmax over the whole vocabulary - onehot(label)) * row_scale,
    in the logits' dtype and computed in float32. The target column is written apart from its
    float32 logit, where p - 1 of a confident target would lose its digits in a rounded p."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    grads = (torch.exp(logits.to(compute) - logsumexp[:, None]) * row_scale[:, None]).to(logits.dtype)
    rows = torch.arange(logits.shape[0], device=logits.device)
    target_grad = (torch.exp(target_logit - logsumexp) - 1) * row_scale
    grads[rows, columns] = torch.where(label_here, target_grad.to(logits.dtype), grads[rows, columns])
    return grads


# one fused pass per chunk each on CUDA (reading the bf16 logits, never a float32 copy of them)
_fused_chunk_statistics = fused(_chunk_statistics)
_fused_chunk_logit_grads = fused(_chunk_logit_grads)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """One rank holding the whole vocabulary: the gradients are made in the forward, chunk by chunk,
    right after each chunk's log-sum-exp (so no logits are recomputed), and scaled by the loss's
    gradient in the backward. Vocabulary-parallel: the log-sum-exp is global, known only after every
    chunk, so the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, vocab_start, group):
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        valid = labels != ignore_index
        num_valid = valid.sum()
        local_labels = labels - vocab_start
        label_here = valid & (local_labels >= 0) & (local_labels < weight.shape[0])
        local_labels = torch.where(label_here, local_labels, 0)
        row_scale = valid.to(accumulate) / num_valid.clamp(min=1)
        split_vocabulary = group is not None and dist.get_world_size(group) > 1
        gradients_here = not split_vocabulary and any(ctx.needs_input_grad[:2])
        grad_hidden = torch.empty_like(hidden) if gradients_here and ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
                       if gradients_here and ctx.needs_input_grad[1] else None)
        # per token: log-sum-exp over these rows, and the target logit (0 where the label is elsewhere)
        stats = torch.empty(2, hidden.shape[0], dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logits = h @ weight.t()
            stats[0, start:end], stats[1, start:end] = _fused_chunk_statistics(
                logits, local_labels[start:end], label_here[start:end])
            if gradients_here:
                grad_logits = _fused_chunk_logit_grads(logits, local_labels[start:end], label_here[start:end],
                                                       stats[0, start:end], stats[1, start:end], row_scale[start:end])
                del logits  # before the two matmuls: one chunk's logits or gradients alive at a time
                _accumulate_chunk_grads(grad_logits, h, weight, grad_hidden, grad_weight, start, end)
        local_logsumexp, local_target_logit = stats[0], stats[1]
        if split_vocabulary:
            gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, stats, group=group)
            all_stats = torch.stack(gathered)
            logsumexp, target_logit = torch.logsumexp(all_stats[:, 0], dim=0), all_stats[:, 1].sum(0)
        else:
            logsumexp, target_logit = local_logsumexp, local_target_logit
        loss_sum = ((logsumexp - target_logit) * valid).sum()
        ctx.gradients_made = gradients_here
        if gradients_here:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight.dtype
        else:
            ctx.save_for_backward(hidden, weight, local_labels, label_here, logsumexp, local_target_logit, row_scale)
            ctx.chunk_size = chunk_size
        return loss_sum / num_valid.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.gradients_made:
            grad_hidden, grad_weight = ctx.saved_tensors
            if grad_hidden is not None:
                grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
            if grad_weight is not None:
                grad_weight = (grad_weight * grad_loss.to(grad_weight.dtype)).to(ctx.weight_dtype)
            return grad_hidden, grad_weight, None, None, None, None, None
        hidden, weight, local_labels, label_here, logsumexp, local_target_logit, row_scale = ctx.saved_tensors
        row_scale = row_scale * grad_loss.to(row_scale.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=logsumexp.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            grad_logits = _fused_chunk_logit_grads(h @ weight.t(), local_labels[start:end], label_here[start:end],
                                                   logsumexp[start:end], local_target_logit[start:end],
                                                   row_scale[start:end])
            _accumulate_chunk_grads(grad_logits, h, weight, grad_hidden, grad_weight, start, end)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _accumulate_chunk_grads(grad_logits, h, weight, grad_hidden, grad_weight, start, end) -> None:
    """grad_hidden[start:end] = grad_logits @ weight; grad_weight (float32, across chunks, rounded
    once at the end) += grad_logits.T @ h."""
    if grad_hidden is not None:
        grad_hidden[start:end] = grad_logits @ weight
    if grad_weight is not None:
        if grad_weight.dtype == grad_logits.dtype:
            grad_weight.addmm_(grad_logits.t(), h)
        elif _adds_products_into_float32(grad_weight.device):
            torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=grad_weight.dtype, out=grad_weight)
        else:
            grad_weight.add_(grad_logits.t() @ h)


@functools.cache
def _adds_products_into_float32(device: torch.device) -> bool:
    """Whether torch.addmm adds a half-precision product into a float32 tensor in place here
    (out_dtype on CUDA): one matmul pass instead of a rounded product and a float32 add over the
    whole V x H weight per chunk (docs/performance.md has what the adds cost)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(4, 8, device=device, dtype=torch.bfloat16)
        accumulator = torch.ones(4, 4, device=device)
        torch.addmm(accumulator, a, a.t(), out_dtype=torch.float32, out=accumulator)
        return bool((accumulator == 9).all())
    except (RuntimeError, TypeError):
        return False
