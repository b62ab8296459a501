"""Causal softmax attention with grouped KV heads and per-document masking: the kernels the gated
attention layers can run, and `causal_attention`, the one place that picks one per call.

Backends (the config's `attention_backend`):
- "sdpa": torch's SDPA (cuDNN on the H200) for a pack that is one document; `varlen_attn`
  (FlashAttention-2) for a pack of several documents on CUDA, else one SDPA call per document.
- "fa4": FlashAttention-4 (`pip install flash-attn-4`: CuTe DSL kernels for Hopper and Blackwell),
  dense for one document, varlen for a pack.
- "auto": fa4 for packs of several documents where it runs; for one document of at least
  FA4_FORWARD_MIN_TOKENS tokens FA4's forward with cuDNN's backward (FA4ForwardCudnnBackward); sdpa
  for the rest. On the H200, with the 0.8B model's heads (8 query, 2 KV, d = 256): over packs of 8
  documents FA4 ran forward + backward 1.12-1.62x faster than varlen_attn; over one document FA4's
  forward is 1.13-1.39x cuDNN's and its backward 0.86-0.97x, and FA4's forward with cuDNN's backward
  ran 1.05x faster than cuDNN alone at 131072 tokens, 0.97x at 32768 (docs/performance.md, eleventh
  session).
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "sdpa", "fa4")
# compute capabilities (major) FlashAttention-4 has forward and backward kernels for
FA4_ARCHS = (9, 10, 11)
# what FlashAttention kernels (FA4 and torch's varlen_attn) take
HALF_DTYPES = (torch.bfloat16, torch.float16)
# one document at least this long: FA4's forward, cuDNN's backward (measured faster at 131072, slower at 32768)
FA4_FORWARD_MIN_TOKENS = 131072

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMETERS = inspect.signature(_varlen_attn).parameters
except ImportError:
    _varlen_attn, _VARLEN_PARAMETERS = None, {}


@functools.cache
def _fa4_functions():
    """(flash_attn_func, flash_attn_varlen_func), or the reason they do not import. Imported on first
    use: loading the CuTe DSL takes seconds."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        return f"flash-attn-4 does not import ({error}); pip install flash-attn-4"
    return flash_attn_func, flash_attn_varlen_func


def fa4_unavailable_reason(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                           head_dim: int | None = None) -> str | None:
    """Why FlashAttention-4 cannot run attention on this device, dtype and head dim (None: it can;
    head_dim None: any it takes)."""
    if device.type != "cuda":
        return f"FlashAttention-4 runs on CUDA devices, got {device.type}"
    if dtype not in HALF_DTYPES:
        return f"FlashAttention-4 takes bfloat16 or float16, got {dtype}"
    if head_dim is not None and (not 8 <= head_dim <= 256 or head_dim % 8):
        return f"FlashAttention-4 takes head dims 8-256 in multiples of 8, got {head_dim}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHS:
        return f"FlashAttention-4's backward has kernels for compute capability 9.x-11.x, this GPU is {major}.{minor}"
    functions = _fa4_functions()
    return functions if isinstance(functions, str) else None


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")


def causal_attention(q, k, v, documents=None, backend: str = "auto") -> torch.Tensor:
    """q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D], scale D^-0.5. `documents` (a
    qwen_hybrid.layers.DocumentLayout, B = 1): each document attends only to itself."""
    _check_backend(backend)
    packed = documents is not None and documents.max_seqlen != q.shape[1]
    long_document = not packed and q.shape[1] >= FA4_FORWARD_MIN_TOKENS
    if backend == "fa4" or (backend == "auto" and (packed or long_document)):
        reason = fa4_unavailable_reason(q.device, q.dtype, q.shape[-1])
        if reason is None:
            if backend == "auto" and long_document:
                return FA4ForwardCudnnBackward.apply(q, k, v)
            return _fa4(q, k, v, documents if packed else None)
        if backend == "fa4":
            raise ValueError(f"attention_backend='fa4': {reason} (attention_backend=auto picks what runs here)")
    return _sdpa_backends(q, k, v, documents if packed else None)


def attention_kernels(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What `causal_attention` runs under `backend` on this device, in words (the run log says it, so
    that "auto" never leaves a user guessing whether FlashAttention-4 ran)."""
    _check_backend(backend)
    sdpa = "torch SDPA for one document, varlen_attn (FlashAttention-2) for a pack on CUDA"
    if backend == "sdpa":
        return f"sdpa: {sdpa}"
    reason = fa4_unavailable_reason(device, dtype, head_dim)
    if backend == "fa4":
        return "fa4: FlashAttention-4 for every pack" if reason is None else f"fa4: cannot run: {reason}"
    if reason is not None:
        return f"auto: {sdpa} (FlashAttention-4 not used: {reason})"
    return (f"auto: FlashAttention-4 for a pack of several documents; for one document of >= "
            f"{FA4_FORWARD_MIN_TOKENS} tokens its forward with cuDNN's backward; else {sdpa}")


def _fa4(q, k, v, documents) -> torch.Tensor:
    dense, varlen = _fa4_functions()
    if documents is None:
        out = dense(q, k, v, causal=True)
    else:
        out = varlen(q[0], k[0], v[0], cu_seqlens_q=documents.cu_seqlens, cu_seqlens_k=documents.cu_seqlens,
                     max_seqlen_q=documents.max_seqlen, max_seqlen_k=documents.max_seqlen, causal=True)
    out = out[0] if isinstance(out, tuple) else out  # some releases return (out, lse)
    return out if documents is None else out.unsqueeze(0)


class FA4ForwardCudnnBackward(torch.autograd.Function):
    """One document: FlashAttention-4's forward (1.13-1.39x cuDNN's at head dim 256) with cuDNN's
    backward (1.03-1.17x FA4's), handing FA4's log-sum-exp to cuDNN. q [B, T, H, D]; k, v
    [B, T, Hkv, D]. Checked against float64 autograd on the H200 (tests/qwen_hybrid/test_attention.py)."""

    @staticmethod
    def forward(ctx, q, k, v):
        dense, _ = _fa4_functions()
        out, lse = dense(q, k, v, causal=True, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        # cuDNN reads [B, H, T, D] views whose strides match each other's (and out's), and its
        # statistics as [B, H, T, 1]
        head_first = [t.transpose(1, 2) for t in (grad_out.contiguous(), q, k, v, out)]
        unused_rng = torch.zeros((), dtype=torch.long, device=q.device)  # dropout's seed and offset
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *head_first, lse.unsqueeze(-1), unused_rng, unused_rng, None, None, None, q.shape[1], k.shape[1], 0.0,
            True, scale=q.shape[-1] ** -0.5)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _sdpa_backends(q, k, v, documents) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    if documents is None:
        return sdpa_causal(q, k, v, scale)
    if q.is_cuda and _varlen_attn is not None and q.dtype in HALF_DTYPES:
        return varlen_causal(q[0], k[0], v[0], documents.cu_seqlens, documents.max_seqlen, scale).unsqueeze(0)
    bounds = documents.cu_seqlens_cpu.tolist()
    outs = [sdpa_causal(q[:, start:end], k[:, start:end], v[:, start:end], scale)
            for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    return torch.cat(outs, dim=1)


def varlen_attn_available() -> bool:
    return _varlen_attn is not None


def varlen_causal(q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
    """Causal varlen FlashAttention-2 (torch's `varlen_attn`) on [T, H, D]; the keyword for
    causality and GQA support differ between torch releases."""
    if k.shape[1] != q.shape[1] and "enable_gqa" not in _VARLEN_PARAMETERS:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    kwargs = {"scale": scale}
    if "enable_gqa" in _VARLEN_PARAMETERS:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    if "window_size" in _VARLEN_PARAMETERS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def sdpa_causal(q, k, v, scale) -> torch.Tensor:
    """torch's SDPA on [B, T, H, D] tensors, causal, GQA."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
