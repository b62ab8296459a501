"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""
from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Factor on the peak lr for optimizer step `step` (0-based): warmup reaches 1 at step
    warmup_steps - 1 (step 0 already trains), then cosine down to min_lr_ratio at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 1:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - 1))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps, total_steps, min_lr_ratio)
    )
