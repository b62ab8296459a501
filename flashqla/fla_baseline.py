"""fla-core's chunked gated delta rule, the baseline we measure against.

FLA dispatches this op to FlashQLA whenever `flash_qla` is importable; a baseline must run
FLA's own kernels, so routing to FlashQLA is switched off here (FLA reads the variable per call).
"""
from __future__ import annotations

import os

import torch

FLASH_QLA_ROUTING_ENV_VAR = "FLA_FLASH_QLA"


def chunk_gated_delta_rule_fla(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
    cu_seqlens_cpu=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's op on our validated arguments; cu_seqlens_cpu (host offsets) spares FLA its own device reads."""
    if q.device.type != "cuda":
        raise ValueError(f"backend='fla' runs FLA's Triton kernels and needs CUDA tensors, got tensors on {q.device}")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        raise ImportError(
            "backend='fla' needs fla-core: pip install 'flashqla-hybrid[baseline]' (fla-core==0.6.0)"
        ) from error
    os.environ[FLASH_QLA_ROUTING_ENV_VAR] = "0"
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.long()
    if cu_seqlens_cpu is not None:
        cu_seqlens_cpu = cu_seqlens_cpu.long()
    return chunk_gated_delta_rule(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
