"""Vocabulary-parallel embedding, LM head and cross entropy.

Rank r of the tensor-parallel group holds vocabulary rows [r * V/tp, (r + 1) * V/tp) of the
embedding and of the LM head. The loss never forms more than one chunk of this rank's logits,
and across ranks it exchanges only two floats per token (the local log-sum-exp and target
logit): the full vocabulary is never gathered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_hybrid.loss import DEFAULT_CHUNK_SIZE, IGNORE_INDEX, chunked_cross_entropy
from qwen_hybrid.parallel.collectives import (
    copy_to_tensor_parallel,
    gather_last_dim_from_tensor_parallel,
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
    if sum_hidden_gradient:
        hidden = copy_to_tensor_parallel(hidden, group)
    return chunked_cross_entropy(hidden, weight, labels, chunk_size, ignore_index, vocab_start=vocab_start, group=group)
