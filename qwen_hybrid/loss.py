"""Next-token cross entropy over the vocabulary in token chunks.

Only one chunk's float32 logits exist at a time, in the forward and in the backward (which
recomputes them from the saved hidden states and per-token log-sum-exp), so peak memory is
O(chunk_size x vocab) instead of O(tokens x vocab): a 100k-token sequence with Qwen3.5's 248k
vocabulary would otherwise need ~100 GB of float32 logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

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


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, vocab_start, group):
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        valid = labels != ignore_index
        num_valid = valid.sum()
        local_labels = labels - vocab_start
        label_here = valid & (local_labels >= 0) & (local_labels < weight.shape[0])
        local_labels = torch.where(label_here, local_labels, 0)
        # per token: log-sum-exp over these rows, and the target logit (0 where the label is elsewhere)
        stats = torch.empty(2, hidden.shape[0], dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            logits = (hidden[start:end] @ weight.t()).to(accumulate)
            stats[0, start:end] = torch.logsumexp(logits, dim=-1)
            stats[1, start:end] = logits.gather(1, local_labels[start:end, None])[:, 0] * label_here[start:end]
            del logits
        local_logsumexp, local_target_logit = stats[0], stats[1]
        if group is not None and dist.get_world_size(group) > 1:
            gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, stats, group=group)
            all_stats = torch.stack(gathered)
            logsumexp, target_logit = torch.logsumexp(all_stats[:, 0], dim=0), all_stats[:, 1].sum(0)
        else:
            logsumexp, target_logit = local_logsumexp, local_target_logit
        loss_sum = ((logsumexp - target_logit) * valid).sum()
        ctx.save_for_backward(hidden, weight, local_labels, label_here, valid, logsumexp, local_logsumexp,
                              local_target_logit, num_valid)
        ctx.chunk_size = chunk_size
        return loss_sum / num_valid.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_loss):
        (hidden, weight, local_labels, label_here, valid, logsumexp, local_logsumexp, local_target_logit,
         num_valid) = ctx.saved_tensors
        # d loss / d logits = (softmax over the whole vocabulary - onehot) * valid * grad / num_valid.
        # The softmax of this chunk's rows is taken in the logits' dtype (computed in float32 inside,
        # one read and one write of the chunk) and rescaled from these vocabulary rows to all of
        # them by exp(local lse - lse); the target column, where softmax - 1 can cancel, comes in
        # float32 from the saved target logit.
        accumulate = logsumexp.dtype
        row_scale = valid.to(accumulate) * (grad_loss.to(accumulate) / num_valid.clamp(min=1))
        softmax_scale = row_scale * torch.exp(local_logsumexp - logsumexp)
        target_grad = (torch.exp(local_target_logit - logsumexp) - 1) * row_scale * label_here
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # accumulate the weight gradient in float32 across chunks, round once at the end
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            grad_logits = torch.softmax(h @ weight.t(), dim=-1)
            grad_logits.mul_(softmax_scale[start:end, None])
            rows = torch.arange(end - start, device=hidden.device)
            here = label_here[start:end]
            columns = local_labels[start:end]
            grad_logits[rows, columns] = torch.where(here, target_grad[start:end].to(grad_logits.dtype),
                                                     grad_logits[rows, columns])
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(grad_logits.t() @ h)
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
