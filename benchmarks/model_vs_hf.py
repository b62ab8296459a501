"""Step time and peak memory of one forward+backward of ours against HF's Qwen3_5ForCausalLM.

    python -m benchmarks.model_vs_hf '[{"size": "0.8B", "tokens": 16384, "backend": "tilelang"},
                                        {"impl": "hf", "size": "0.8B", "tokens": 16384},
                                        {"impl": "hf", "size": "0.8B", "tokens": 16384, "hf_gdn": "flashqla"}]'

A case: impl ("ours" | "hf"), size (a named size), tokens, docs (equal documents packed with
cu_seqlens; HF gets one unpacked sequence), backend (our GDN backend), hf_gdn (HF's GDN op: "fla",
FLA's own kernels, or "flashqla", FLA handing the call to FlashQLA), ckpt (activation checkpointing),
steps, profile (N > 0: one more step under torch.profiler; its N costliest GPU kernels and host
ops are printed). Random bf16 weights on the current CUDA device; each result is printed and appended as a
JSON line to $OUT/bench.jsonl when OUT is set, and at the end every case's step time and peak memory
as a ratio to the first case's. The first step includes kernel compilation.
Run from the repository root.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import sys
import time

import torch

from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM


def build(impl: str, config: QwenHybridConfig, ckpt: bool) -> torch.nn.Module:
    with torch.device("cuda"):
        if impl == "ours":
            model = QwenHybridForCausalLM(config).to(torch.bfloat16)
            model.set_activation_checkpointing(ckpt)
        elif impl == "hf":
            import transformers

            model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config.to_hf()))
            model = model.to(torch.bfloat16)
            if ckpt:
                model.gradient_checkpointing_enable()
        else:
            raise ValueError(f"impl must be 'ours' or 'hf', got {impl!r}")
    return model.train()


HF_GDN = ("fla", "flashqla")


@contextlib.contextmanager
def _fla_hands_to_flashqla(hf_gdn: str):
    """fla-core 0.6 hands its public op to FlashQLA when flash_qla imports, unless FLA_FLASH_QLA=0
    (read on every call): set for the case, restored after. Only this script writes it."""
    previous = os.environ.get("FLA_FLASH_QLA")
    os.environ["FLA_FLASH_QLA"] = "1" if hf_gdn == "flashqla" else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("FLA_FLASH_QLA")
        else:
            os.environ["FLA_FLASH_QLA"] = previous


def measure(impl="ours", size="0.8B", tokens=32768, docs=1, backend="auto", ckpt=False, steps=3, profile=0,
            hf_gdn="fla") -> dict:
    if hf_gdn not in HF_GDN:
        raise ValueError(f"hf_gdn must be one of {HF_GDN}, got {hf_gdn!r}")
    if impl == "hf":
        with _fla_hands_to_flashqla(hf_gdn):
            return _measure(impl, size, tokens, docs, backend, ckpt, steps, profile, hf_gdn)
    return _measure(impl, size, tokens, docs, backend, ckpt, steps, profile, None)


def _measure(impl, size, tokens, docs, backend, ckpt, steps, profile, hf_gdn) -> dict:
    case = dict(impl=impl, size=size, tokens=tokens, docs=docs, backend=backend, ckpt=bool(ckpt))
    if hf_gdn is not None:
        case["hf_gdn"] = hf_gdn
    config = QwenHybridConfig.named(size, gdn_backend=backend)
    torch.manual_seed(0)
    model = build(impl, config, bool(ckpt))
    input_ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
    cu_seqlens = None
    if docs > 1:
        cu_seqlens = torch.linspace(0, tokens, docs + 1, device="cuda").round().to(torch.int32)

    def step():
        if impl == "ours":
            loss = model(input_ids, cu_seqlens=cu_seqlens, labels=input_ids).loss
        else:
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    try:
        start = time.time()
        step()
        torch.cuda.synchronize()
        first_step_s = time.time() - start
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        step_ms = sorted(times)[len(times) // 2]
        result = dict(case, first_step_s=round(first_step_s, 1), step_ms=round(step_ms, 1),
                      tokens_per_s=round(tokens / step_ms * 1000), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      loss=round(loss.item(), 4))
        if profile:
            result.update(profile_one_step(step, profile))
    except torch.OutOfMemoryError as error:
        result = dict(case, error=f"out of memory: {str(error)[:160]}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def profile_one_step(step, count: int) -> dict:
    """One more step under torch.profiler; prints where its time went (train.metrics.profile_summary)."""
    from torch.profiler import ProfilerActivity, profile

    from train.metrics import profile_summary

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    report, record = profile_summary(prof, time.perf_counter() - started, count)
    print(report, flush=True)
    return record


def parse_cases(text: str) -> list[dict]:
    """The CASES argument: a JSON list of objects whose keys are measure()'s parameters."""
    try:
        cases = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}); expected a list like '[{{\"size\": \"0.8B\"}}]'")
    if isinstance(cases, dict):
        cases = [cases]
    known = set(inspect.signature(measure).parameters)
    if not isinstance(cases, list) or not all(isinstance(case, dict) for case in cases):
        raise argparse.ArgumentTypeError(f"expected a JSON list of objects, got {text!r}")
    for case in cases:
        if set(case) - known:
            raise argparse.ArgumentTypeError(f"case {case} has unknown keys {sorted(set(case) - known)}; known: {sorted(known)}")
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.model_vs_hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cases", type=parse_cases, help="JSON list of cases (one object is one case)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        # everything below allocates on the current CUDA device
        print("benchmarks.model_vs_hf: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    results = []
    for case in args.cases:
        result = measure(**case)
        results.append(result)
        print(json.dumps(result), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench.jsonl"), "a") as f:
                f.write(json.dumps(result) + "\n")
    for line in comparison_lines(results):
        print(line, flush=True)
    return 0


def comparison_lines(results: list[dict]) -> list[str]:
    """Each case's step time and peak memory against the first case's (the first is the reference:
    'step 1.17x' means 1.17 times the first case's step time); cases that failed say why."""
    if len(results) < 2 or "step_ms" not in results[0]:
        return []
    first = results[0]
    lines = [f"against case 1 ({_case_name(first)}: {first['step_ms']} ms, {first['peak_gib']} GiB):"]
    for number, result in enumerate(results[1:], start=2):
        if "step_ms" in result:
            lines.append(f"  case {number} ({_case_name(result)}): step {result['step_ms'] / first['step_ms']:.2f}x, "
                         f"peak memory {result['peak_gib'] / first['peak_gib']:.2f}x")
        else:
            lines.append(f"  case {number} ({_case_name(result)}): {result.get('error', 'no result')}")
    return lines


def _case_name(result: dict) -> str:
    gdn = f"GDN by {result['hf_gdn']}" if "hf_gdn" in result else f"backend {result['backend']}"
    return f"{result['impl']} {result['size']} {result['tokens']} tokens, {gdn}"


if __name__ == "__main__":
    sys.exit(main())
