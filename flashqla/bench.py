"""Forward (and backward) timings of our kernels beside FLA's and FlashQLA's.

    python -m flashqla.bench [--fwd] [--bwd] [--json PATH] [--shapes SUBSTR,...] [--baselines fla,flashqla]

Inputs as in docs/anchors.md: bf16 q/k/v (q, k L2-normalised), fp32 g = logsigmoid(randn)/16,
fp32 beta = sigmoid(rand), fp32 initial state, final state on, K = V = 128, B = 1 with cu_seqlens.
Median of triton.testing.do_bench; forward under no_grad; backward = (forward + backward) - forward.
--breakdown adds our per-stage times (planning, cumsum, gated products, walk starts, fused walk).
FlashQLA compiles about a dozen TileLang kernels per head layout on first use (minutes without a
carried TileLang cache); `--baselines fla` leaves it out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

# FLA must run its own kernels, not route to FlashQLA (read when fla is imported and per call).
os.environ.setdefault("FLA_FLASH_QLA", "0")

HEAD_LAYOUTS = {"TP1": (16, 64), "TP1.33": (16, 48), "TP2": (16, 32), "TP2'": (8, 32), "TP2.67": (8, 24),
                "TP4": (4, 16), "TP8": (2, 8), "16/16": (16, 16)}
LENGTHS = {"1x8192": [8192], "1x32768": [32768], "28672+4096": [28672, 4096], "8192x4": [8192] * 4}


def bench_shapes() -> list[tuple[str, tuple[int, int], list[int]]]:
    shapes = [(f"{a}/{b} {length}", (a, b), lens)
              for (a, b) in HEAD_LAYOUTS.values() for length, lens in LENGTHS.items()]
    shapes.append(("2/8 1x131072", (2, 8), [131072]))
    return shapes


def make_inputs(heads: tuple[int, int], seq_lens: list[int], seed: int = 0) -> dict:
    num_qk_heads, num_v_heads = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(seq_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    return dict(
        q=F.normalize(randn(1, total, num_qk_heads, 128), dim=-1).to(torch.bfloat16),
        k=F.normalize(randn(1, total, num_qk_heads, 128), dim=-1).to(torch.bfloat16),
        v=randn(1, total, num_v_heads, 128).to(torch.bfloat16),
        g=F.logsigmoid(randn(1, total, num_v_heads)) / 16,
        beta=torch.rand(1, total, num_v_heads, generator=gen, device="cuda").sigmoid(),
        initial_state=randn(len(seq_lens), num_v_heads, 128, 128),
        cu_seqlens=torch.tensor([0, *seq_lens], device="cuda").cumsum(0).to(torch.int32),
    )


def implementations(baselines: list[str]) -> dict:
    """name -> f(inputs) returning (o, final_state); ours first."""
    from flashqla.api import chunk_gated_delta_rule

    def ours(x):
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True, cu_seqlens=x["cu_seqlens"], backend="tilelang")

    impls = {"ours": ours}
    if "fla" in baselines:
        try:
            import fla  # noqa: F401
        except ImportError:
            print("fla-core not installed: FLA column skipped")
        else:
            def fla_impl(x):
                return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                              initial_state=x["initial_state"], output_final_state=True,
                                              cu_seqlens=x["cu_seqlens"], backend="fla")
            impls["fla"] = fla_impl
    if "flashqla" in baselines:
        try:
            import flash_qla
        except ImportError:
            print("flash-qla not installed: FlashQLA column skipped")
        else:
            def flashqla_impl(x):
                return flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                        initial_state=x["initial_state"], output_final_state=True,
                                                        cu_seqlens=x["cu_seqlens"].long())
            impls["flashqla"] = flashqla_impl
    return impls


def forward_breakdown(inputs: dict, rep_ms: int) -> dict:
    """Median ms of each stage of our forward (cumsum, gated products, planning, fused kernel)."""
    from triton.testing import do_bench

    from flashqla import hopper
    from flashqla.hopper.chunk_plan import plan_forward, walk_starts
    from flashqla.hopper.inverse import gated_products

    q, k, v, g, beta = (inputs[n][0] for n in ("q", "k", "v", "g", "beta"))
    cu = inputs["cu_seqlens"]
    num_tokens, num_v_heads = g.shape
    sm_count = torch.cuda.get_device_properties().multi_processor_count
    plan = plan_forward(cu, num_v_heads, 128, sm_count, hopper.MAX_VALUE_BLOCK)
    index = plan.chunk_index
    gamma = hopper.chunk_local_cumsum(g[None], cu, chunk_index=index).view(num_tokens, num_v_heads)
    gated_inverse, scores = gated_products(q, k, gamma, beta, 128 ** -0.5, cu, index)
    walk = walk_starts(plan.pieces, cu, gamma, -10.0, plan.max_walk_back)
    stages = {
        "plan": lambda: plan_forward(cu, num_v_heads, 128, sm_count, hopper.MAX_VALUE_BLOCK),
        "cumsum": lambda: hopper.chunk_local_cumsum(g[None], cu, chunk_index=index),
        "products": lambda: gated_products(q, k, gamma, beta, 128 ** -0.5, cu, index),
        "walk": lambda: walk_starts(plan.pieces, cu, gamma, -10.0, plan.max_walk_back),
        "fused": lambda: hopper.fused_forward(q, k, v, gamma, gated_inverse, scores, 128 ** -0.5, inputs["initial_state"],
                                             cu, plan.value_block, plan.pieces, walk, offsets=plan.chunk_offsets),
    }
    result = {name: do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") for name, fn in stages.items()}
    result["pieces"] = int(plan.pieces.shape[0])
    result["value_block"] = plan.value_block
    return result


def time_forward(fn, inputs, rep_ms: int) -> float:
    from triton.testing import do_bench

    with torch.no_grad():
        return do_bench(lambda: fn(inputs), warmup=max(rep_ms // 4, 10), rep=rep_ms, return_mode="median")


def time_backward(fn, inputs, rep_ms: int, forward_ms: float) -> float:
    from triton.testing import do_bench

    leaves = {name: inputs[name].detach().requires_grad_(True) for name in ("q", "k", "v", "g", "beta", "initial_state")}
    x = dict(inputs, **leaves)
    o, final_state = fn(x)
    d_o, d_state = torch.randn_like(o), torch.randn_like(final_state)

    def step():
        out, state = fn(x)
        torch.autograd.backward((out, state), (d_o, d_state))

    total = do_bench(step, warmup=max(rep_ms // 4, 10), rep=rep_ms, return_mode="median", grad_to_none=list(leaves.values()))
    return total - forward_ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fwd", action="store_true", help="time the forward (default when --bwd is not given)")
    parser.add_argument("--bwd", action="store_true", help="also time the backward through autograd")
    parser.add_argument("--json", default=None, help="write all timings to this JSON file")
    parser.add_argument("--shapes", default="", help="comma-separated substrings; run only matching shape names")
    parser.add_argument("--baselines", default="fla,flashqla", help="comma-separated: fla, flashqla")
    parser.add_argument("--breakdown", action="store_true", help="also time each stage of our forward")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time per measurement, ms")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flashqla.bench needs a CUDA GPU")
    do_forward = args.fwd or not args.bwd
    impls = implementations([b for b in args.baselines.split(",") if b])
    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in bench_shapes() if not wanted or any(w in s[0] for w in wanted)]

    results = []
    for name, heads, seq_lens in shapes:
        inputs = make_inputs(heads, seq_lens)
        row = {"shape": name, "heads": list(heads), "seq_lens": seq_lens}
        for impl_name, fn in impls.items():
            try:
                forward_ms = time_forward(fn, inputs, args.rep)
                if do_forward:
                    row[f"{impl_name}_fwd_ms"] = forward_ms
                if args.bwd:
                    row[f"{impl_name}_bwd_ms"] = time_backward(fn, inputs, args.rep, forward_ms)
            except Exception as error:  # a baseline failing must not hide the others' numbers
                row[f"{impl_name}_error"] = f"{type(error).__name__}: {error}"[:300]
        if args.breakdown:
            try:
                row["ours_breakdown_ms"] = forward_breakdown(inputs, max(args.rep // 4, 20))
            except Exception as error:
                row["ours_breakdown_error"] = f"{type(error).__name__}: {error}"[:300]
        results.append(row)
        print(format_row(row, impls), flush=True)
        del inputs
        torch.cuda.empty_cache()

    print()
    print(format_table(results, impls, do_forward, args.bwd))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


def format_row(row: dict, impls: dict) -> str:
    parts = [row["shape"]]
    for impl_name in impls:
        for kind in ("fwd", "bwd"):
            key = f"{impl_name}_{kind}_ms"
            if key in row:
                parts.append(f"{impl_name} {kind} {row[key]:.3f} ms")
        if f"{impl_name}_error" in row:
            parts.append(f"{impl_name} ERROR {row[f'{impl_name}_error']}")
    if "ours_breakdown_ms" in row:
        parts.append("stages " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in row["ours_breakdown_ms"].items()))
    return " | ".join(parts)


def format_table(results: list[dict], impls: dict, do_forward: bool, do_backward: bool) -> str:
    kinds = (["fwd"] if do_forward else []) + (["bwd"] if do_backward else [])
    lines = []
    for kind in kinds:
        header = ["shape (Hqk/Hv tokens)"] + [f"{n} {kind} ms" for n in impls]
        header += [f"{n}/ours" for n in impls if n != "ours"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for row in results:
            ours = row.get(f"ours_{kind}_ms")
            cells = [row["shape"]]
            cells += [f"{row[f'{n}_{kind}_ms']:.3f}" if f"{n}_{kind}_ms" in row else "-" for n in impls]
            for n in impls:
                if n == "ours":
                    continue
                other = row.get(f"{n}_{kind}_ms")
                cells.append(f"{other / ours:.2f}" if other and ours else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
