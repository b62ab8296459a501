"""fla-core's chunked gated delta rule, the baseline we measure against (backend="fla").

fla-core 0.6.0 sends its public `chunk_gated_delta_rule` through a backend dispatch that hands the
call to FlashQLA whenever `flash_qla` is importable, unless FLA_FLASH_QLA=0 is in the environment
(read on every call). A baseline must run FLA's own kernels, so we call the function beneath that
dispatch instead: `fla.backends.dispatch` wraps it with functools.wraps, and inspect.unwrap gets
back FLA's own body (its argument checks and its autograd Function), the very function the dispatch
falls back to when no other backend takes the call. Nothing is written into os.environ.
"""
from __future__ import annotations

import functools
import importlib
import inspect

import torch


@functools.cache
def fla_chunk_gated_delta_rule():
    """fla-core's `chunk_gated_delta_rule` without its backend dispatch: FLA's own kernels only."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule.chunk")
    except ImportError as error:
        raise ImportError(
            "backend='fla' needs fla-core: pip install 'flashqla-hybrid[baseline]' (fla-core==0.6.0)"
        ) from error
    dispatched = module.chunk_gated_delta_rule
    own = inspect.unwrap(dispatched)
    if own.__module__ != module.__name__ or own.__name__ != "chunk_gated_delta_rule":
        raise RuntimeError(f"fla-core's chunk_gated_delta_rule unwraps to {own!r}, not to its own body as in "
                           f"fla-core 0.6.0; check the installed version")
    return own


def chunk_gated_delta_rule_fla(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
    cu_seqlens_host: list[int] | None = None, keep_for_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's op on our checked arguments (the "fla" runner of flashqla/backends.py). cu_seqlens_host,
    the offsets as a list, spares FLA its own device->host reads; keep_for_backward is ignored
    (FLA decides what its forward saves)."""
    if q.device.type != "cuda":
        raise ValueError(f"backend='fla' runs FLA's Triton kernels and needs CUDA tensors, got tensors on {q.device}")
    return fla_chunk_gated_delta_rule()(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
        cu_seqlens_cpu=None if cu_seqlens_host is None else torch.tensor(cu_seqlens_host),
    )
