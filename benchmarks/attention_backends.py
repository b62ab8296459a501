"""The model's attention (head dim 256, GQA, causal) through each attention kernel torch offers,
forward and forward + backward, side by side in one process:

    python -m benchmarks.attention_backends [--size 0.8B] [--tokens 8192,32768,131072] [--docs 1,8] [--backends a,b]

Backends: SDPA's cuDNN, FlashAttention and memory-efficient kernels for one document; for packed
documents cuDNN's SDPA once per document against `varlen_attn` (FlashAttention over the pack);
FlexAttention (torch.compile'd, a causal or causal-per-document block mask built once per shape,
outside the timing) for both; and FlashAttention-4 (`flash-attn-4` from PyPI, CuTe DSL, with SM90
kernels up to head dim 256) for both, where it imports, and for one document its forward with
cuDNN's backward (`qwen_hybrid.attention.FA4ForwardCudnnBackward`, what `auto` runs over one
long document).
(cuDNN's ragged op, `aten._cudnn_attention_forward` with offsets, measured exact but 10-100x slower
and failing at 131072 tokens on the H200: docs/performance.md, 2026-12-01 fifth session.) Prints per shape each backend's milliseconds and its ratio to cuDNN, and each
output's largest difference from cuDNN's. Appends JSON lines to $OUT/attention.jsonl when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwen_hybrid import QwenHybridConfig
from qwen_hybrid.attention import FA4ForwardCudnnBackward, causal_attention, fa4_unavailable_reason, varlen_attn_available, varlen_causal
from qwen_hybrid.layers import DocumentLayout

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _sdpa(backend):
    def run(q, k, v, documents):
        if documents is not None:
            raise NotImplementedError("one document per call")
        with sdpa_kernel([SDPA_BACKENDS[backend]]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)
    return run


def _cudnn_per_document(q, k, v, documents):
    bounds = documents.cu_seqlens_cpu.tolist()
    run = _sdpa("cudnn")
    return torch.cat([run(q[:, a:b], k[:, a:b], v[:, a:b], None) for a, b in zip(bounds[:-1], bounds[1:]) if b > a],
                     dim=1)


def _varlen(q, k, v, documents):
    cu = documents.cu_seqlens
    return varlen_causal(q[0], k[0], v[0], cu, documents.max_seqlen, q.shape[-1] ** -0.5).unsqueeze(0)


def _flex():
    """FlexAttention with a block mask per (length, documents), cached so that only the kernel is timed."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, documents):
        tokens = q.shape[1]
        key = (tokens, None if documents is None else tuple(documents.cu_seqlens_cpu.tolist()))
        if key not in masks:
            if documents is None:
                def mask(b, h, q_idx, kv_idx):
                    return q_idx >= kv_idx
            else:
                doc = torch.searchsorted(documents.cu_seqlens[1:].long(), torch.arange(tokens, device=q.device),
                                         right=True)

                def mask(b, h, q_idx, kv_idx):
                    return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
            masks[key] = create_block_mask(mask, None, None, tokens, tokens, device=q.device)
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=masks[key],
                       enable_gqa=True)
        return out.transpose(1, 2)
    return run


def _fa4(q, k, v, documents):
    return causal_attention(q, k, v, documents, backend="fa4")


def _fa4_cudnn(q, k, v, documents):
    if documents is not None:
        raise NotImplementedError("one document per call")
    return FA4ForwardCudnnBackward.apply(q, k, v)


def _time(fn, backward: bool) -> float:
    import triton.testing

    if backward:
        def step():
            out = fn()
            out.backward(torch.ones_like(out))
    else:
        step = fn
    return triton.testing.do_bench(step, warmup=3, rep=20)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8B")
    parser.add_argument("--tokens", default="8192,32768,131072")
    parser.add_argument("--docs", default="1,8", help="equal documents per packed sequence")
    parser.add_argument("--backends", default="", help="comma-separated backends to run (default: all)")
    args = parser.parse_args(argv)
    config = QwenHybridConfig.named(args.size)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out_path = os.path.join(os.environ["OUT"], "attention.jsonl") if os.environ.get("OUT") else None
    flex = _flex()
    with_fa4 = fa4_unavailable_reason(torch.device("cuda"), torch.bfloat16, dim) is None
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for docs in [int(d) for d in args.docs.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(1, tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(1, tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            documents = None
            if docs == 1:
                candidates = {name: _sdpa(name) for name in SDPA_BACKENDS}
                candidates["flex"] = flex
                if with_fa4:
                    candidates["fa4"] = _fa4
                    candidates["fa4_fwd_cudnn_bwd"] = _fa4_cudnn
            else:
                documents = DocumentLayout.build(torch.linspace(0, tokens, docs + 1).long(), "cuda")
                candidates = {"cudnn_per_document": _cudnn_per_document}
                if varlen_attn_available():
                    candidates["varlen"] = _varlen
                candidates["flex"] = flex
                if with_fa4:
                    candidates["fa4"] = _fa4
            if args.backends:
                candidates = {name: run for name, run in candidates.items() if name in args.backends.split(",")}
            results, reference = {}, None
            for name, run in candidates.items():
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                try:
                    out = run(*leaves, documents)
                    fwd = _time(lambda: run(*leaves, documents), backward=False)
                    both = _time(lambda: run(*leaves, documents), backward=True)
                except Exception as error:  # a backend that refuses this shape is reported, not fatal
                    results[name] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
                    continue
                if reference is None:
                    reference = out.detach()
                results[name] = {"fwd_ms": fwd, "bwd_ms": both - fwd,
                                 "max_diff": (out.detach().float() - reference.float()).abs().max().item()}
                del out, leaves
                torch.cuda.empty_cache()
            base = next((r for r in results.values() if "fwd_ms" in r), None)
            for name, result in results.items():
                if "fwd_ms" in result and base is not None:
                    result["fwd_vs_first"] = base["fwd_ms"] / result["fwd_ms"]
                    result["bwd_vs_first"] = base["bwd_ms"] / result["bwd_ms"]
                line = {"size": args.size, "tokens": tokens, "docs": docs, "backend": name, **result}
                print(json.dumps(line), flush=True)
                if out_path:
                    with open(out_path, "a") as f:
                        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
