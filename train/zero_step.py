"""The ZeRO-1/2 optimizer's gradient checks in one pass instead of one pass per tensor.

DeepSpeed's ZeRO-1/2 step (0.19.x, `DeepSpeedZeroOptimizer.step`) runs two scans over every
gradient tensor before it clips:
- an overflow check: `isfinite` and friends per tensor, ~14 kernel launches each, then an
  all-reduce and a host read;
- the norm: each tensor cast to float64 (a copy of the gradients in float64) and its norm taken,
  two launches each.
With 320 tensors that is ~5,000 launches a step, which is what leaves the GPU idle at short
sequence lengths (docs/performance.md). In bf16 and fp32 there is no loss scale for the overflow
check to adjust, and DeepSpeed already skips the step when the norm is not finite; a norm is not
finite exactly when a gradient is not. So the per-tensor check is redundant, and the norm can be
taken in one multi-tensor pass in float32 (accumulated per tensor in float32, then summed).

`streamline_zero_step(optimizer)` replaces those two methods on one optimizer instance when its
configuration is one where the above holds, and otherwise leaves it alone and says why. Which
steps are skipped does not change: DeepSpeed skips on a non-finite norm in fp32 always and in
bf16 when `bf16.check_grad_overflow` is on (the default), as before.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def why_not_streamlined(optimizer) -> str | None:
    """None when `streamline_zero_step` applies to this optimizer, else the reason it does not."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return "deepspeed's ZeRO-1/2 optimizer is not importable"
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return f"the optimizer is {type(optimizer).__name__}, not DeepSpeed's ZeRO-1/2 optimizer"
    if optimizer.dtype not in (torch.bfloat16, torch.float32):
        return f"the gradients are {optimizer.dtype}: fp16 needs the loss scaler's overflow check"
    for attribute in ("check_overflow", "get_grad_norm_direct", "check_grad_overflow", "dp_process_group"):
        if not hasattr(optimizer, attribute):
            return f"this DeepSpeed's ZeRO optimizer has no {attribute!r} (a version this was not written for)"
    if not getattr(optimizer, "compute_grad_norm", True):
        return "the gradient norm is off (zero_optimization.compute_grad_norm=false): the overflow check is the only guard"
    if optimizer.cpu_offload:
        return "the optimizer is offloaded (its norm is computed on the CPU)"
    if getattr(optimizer, "has_moe_layers", False):
        return "the model has MoE layers (expert norms are averaged apart)"
    from deepspeed.comm import pg_utils

    if pg_utils.is_parallel(optimizer.model_parallel_group):
        return "tensor or context parallel: DeepSpeed counts each model-parallel shard once"
    return None


def streamline_zero_step(optimizer) -> str | None:
    """Make `optimizer`'s step check its gradients in one pass; returns None when done, else why not."""
    reason = why_not_streamlined(optimizer)
    if reason is not None:
        return reason

    def check_overflow(partition_gradients=True):
        # the norm below finds every inf or NaN gradient, and DeepSpeed skips the step on a norm that
        # is not finite wherever it would run this check (fp32 always, bf16 with check_grad_overflow)
        optimizer.overflow = False

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: the one-pass gradient norm is the L2 norm only")
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if grads:
            per_tensor = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            squares = torch.stack(per_tensor).square().sum()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=optimizer.device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        norm = squares.sqrt()
        # DeepSpeed's convention for a norm that is not finite: -1 (its step then counts an overflow)
        return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, -1.0))

    optimizer.check_overflow = check_overflow
    optimizer.get_grad_norm_direct = get_grad_norm_direct
    return None
