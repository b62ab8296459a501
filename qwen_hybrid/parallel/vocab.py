"""Vocabulary-parallel embedding, LM head and cross entropy.

Rank r of the tensor-parallel group holds vocabulary rows [r * V/tp, (r + 1) * V/tp) of the
embedding and of the LM head. The loss never forms more than one chunk of this rank's logits,
and across ranks it exchanges only two floats per token (the local log-sum-exp and target
logit): the full vocabulary is never gathered.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qwen_hybrid.loss import DEFAULT_CHUNK_SIZE, IGNORE_INDEX
from qwen_hybrid.parallel.collectives import (
    copy_to_tensor_parallel,
    gather_last_dim_from_tensor_parallel,
    group_size,
    reduce_from_tensor_parallel,
    reduce_scatter_tokens,
)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [vocab_start, vocab_start + weight.shape[0]) of the token embedding; other
    tokens embed to zero here and the all-reduce over the group fills them in (with
    `sequence_parallel` a reduce-scatter, leaving this rank its slice of the tokens)."""

    def __init__(
        self, weight: nn.Parameter, vocab_start: int, vocab_size: int, padding_idx: int | None, group,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.padding_idx = padding_idx
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_rows = self.weight.shape[0]
        local_ids = input_ids - self.vocab_start
        here = (local_ids >= 0) & (local_ids < local_rows)
        local_padding = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < local_rows:
            local_padding = self.padding_idx - self.vocab_start
        embedded = F.embedding(torch.where(here, local_ids, 0), self.weight, padding_idx=local_padding)
        embedded = embedded * here.unsqueeze(-1).to(embedded.dtype)
        if self.sequence_parallel:
            return reduce_scatter_tokens(embedded, self.group)
        return reduce_from_tensor_parallel(embedded, self.group)

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return f"rows {self.vocab_start}..{self.vocab_start + rows} of {self.vocab_size}, dim {self.weight.shape[1]}"


class VocabParallelLMHead(nn.Module):
    """Drop-in for the model's `LMHead` over this rank's vocabulary rows: without labels it returns
    the full logits (gathered over the group); with labels the vocabulary-parallel chunked loss.

    `hidden_gathered`: the hidden state arrives through `gather_tokens` (sequence parallelism),
    whose backward already sums the partial hidden gradients of the ranks."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, vocab_size: int, group, hidden_gathered: bool = False):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size
        self.group = group
        self.hidden_gathered = hidden_gathered

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE):
        if labels is None:
            if not self.hidden_gathered:
                hidden = copy_to_tensor_parallel(hidden, self.group)
            return gather_last_dim_from_tensor_parallel(F.linear(hidden, self.weight), self.group)
        return vocab_parallel_cross_entropy(
            hidden, self.weight, labels, self.vocab_start, self.group, chunk_size=chunk_size,
            sum_hidden_gradient=not self.hidden_gathered,
        )

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return f"rows {self.vocab_start}..{self.vocab_start + rows} of {self.vocab_size}, dim {self.weight.shape[1]}"


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
    sum_hidden_gradient: bool = True,
) -> torch.Tensor:
    """Mean cross entropy of the logits `hidden @ full_weight.T`, where this rank holds the rows
    `weight` = full_weight[vocab_start : vocab_start + weight.shape[0]].

    hidden: [T, H], the same on every rank of `group`; labels: [T] global token ids (already
    shifted), `ignore_index` skipped. Returns the same float32 scalar on every rank (float64 for
    float64 inputs). The backward gives this rank's weight rows their full gradient, and hidden the
    sum over the group of the ranks' partial gradients; `sum_hidden_gradient=False` leaves it
    partial, for a hidden that came through a collective summing it in its own backward.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V_local, H={hidden.shape[1]}], got shape {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T={hidden.shape[0]}], got shape {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share a dtype, got hidden {hidden.dtype}, weight {weight.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if sum_hidden_gradient:
        hidden = copy_to_tensor_parallel(hidden, group)
    return _VocabParallelCrossEntropy.apply(hidden, weight, labels, vocab_start, group, chunk_size, ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, group, chunk_size, ignore_index):
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        local_rows = weight.shape[0]
        valid = labels != ignore_index
        num_valid = valid.sum()
        local_labels = labels - vocab_start
        label_here = valid & (local_labels >= 0) & (local_labels < local_rows)
        local_labels = torch.where(label_here, local_labels, 0)
        # per token: this rank's log-sum-exp and target logit (0 where the label lives elsewhere)
        stats = torch.empty(2, hidden.shape[0], dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            logits = (hidden[start:end] @ weight.t()).to(accumulate)
            stats[0, start:end] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, local_labels[start:end, None])[:, 0]
            stats[1, start:end] = target * label_here[start:end]
            del logits
        if group_size(group) > 1:
            gathered = [torch.empty_like(stats) for _ in range(group_size(group))]
            dist.all_gather(gathered, stats, group=group)
            all_stats = torch.stack(gathered)
            logsumexp = torch.logsumexp(all_stats[:, 0], dim=0)
            target_logit = all_stats[:, 1].sum(0)
        else:
            logsumexp, target_logit = stats[0], stats[1]
        loss_sum = ((logsumexp - target_logit) * valid).sum()
        ctx.save_for_backward(hidden, weight, local_labels, label_here, valid, logsumexp, num_valid)
        ctx.chunk_size = chunk_size
        ctx.group = group
        return loss_sum / num_valid.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_labels, label_here, valid, logsumexp, num_valid = ctx.saved_tensors
        # d loss / d local logits = (softmax over the full vocabulary - onehot) * valid * grad / num_valid;
        # the hidden gradient from this rank's rows alone is partial: the caller's collective sums it
        accumulate = logsumexp.dtype
        row_scale = valid.to(accumulate) * (grad_loss.to(accumulate) / num_valid.clamp(min=1))
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            grad_logits = (h @ weight.t()).to(accumulate)
            grad_logits.sub_(logsumexp[start:end, None]).exp_()
            rows = torch.arange(end - start, device=hidden.device)
            grad_logits[rows, local_labels[start:end]] -= label_here[start:end].to(accumulate)
            grad_logits.mul_(row_scale[start:end, None])
            grad_logits = grad_logits.to(weight.dtype)
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
