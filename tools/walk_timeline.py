"""Where a chunk's time goes in the forward walk (or with --backward the fused reverse walk), role by role, from
the SM's clock (needs an SM90 GPU).

    python tools/walk_timeline.py [--heads 16/64] [--lengths 32768] [--keep everything|nothing]
                                  [--skip 4] [--option NAME] [--json PATH] [--backward [--model]] [--spread]

Runs flashqla/hopper/fused_forward.py's walk once with `record_timeline` (each role's first thread
reads clock64 at the TIMELINE_EVENTS of its loop, for the first TIMELINE_CHUNKS chunks of every CTA)
on the bench's inputs and the forward's own plan, and prints, for every role, the median cycles from
each event to the next over all CTAs and their chunks past the first --skip (warm-up: the loads of
the first chunks), beside the chunk period (the state warpgroup's median cycles from one chunk's top
to the next's). A segment that ends at a barrier wait ("tiles", "state_ready", ...) is that role
waiting on another; the others are its own work. docs/kernel-notes.md says what it found.
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarize(stamps: np.ndarray, events: dict[str, tuple[str, ...]], skip: int) -> dict:
    """{"period": cycles, role: [(segment, median cycles), ...]} from int64 stamps [CTA, role, chunk,
    slot] (0 where nothing was written: chunks a CTA did not walk). A role's segment "a -> b" runs from
    event a to the next event b of the same chunk; its last segment runs to the next chunk's first event."""
    summary = {}
    for role_index, (role, names) in enumerate(events.items()):
        clocks = stamps[:, role_index, :, :len(names)].astype(np.float64)        # [CTA, chunk, event]
        next_tops = np.concatenate([clocks[:, 1:, :1], np.zeros_like(clocks[:, :1, :1])], axis=1)
        ends = np.concatenate([clocks[:, :, 1:], next_tops], axis=2)           # where each segment ends
        segments = []
        labels = [f"{a} -> {b}" for a, b in zip(names, names[1:])] + [f"{names[-1]} -> next top"]
        for index, label in enumerate(labels):
            start, end = clocks[:, skip:, index], ends[:, skip:, index]
            valid = (start != 0) & (end != 0)
            segments.append((label, float(np.median((end - start)[valid])) if valid.any() else float("nan")))
        summary[role] = segments
        if role_index == 0:
            tops = clocks[:, :, 0]
            period = tops[:, skip + 1:] - tops[:, skip:-1]
            valid = (tops[:, skip + 1:] != 0) & (tops[:, skip:-1] != 0)
            summary["period"] = float(np.median(period[valid])) if valid.any() else float("nan")
    return summary


def spread(stamps: np.ndarray, events: dict[str, tuple[str, ...]], own: tuple[str, str] | None = None) -> dict:
    """How chunk periods spread over CTAs and chunks (where the median of `summarize` hides a slow CTA or chunk),
    from the same stamps: per CTA the chunks recorded and its cycles from the first chunk's top to the last's,
    percentiles of every chunk period, the median period by chunk index, and the four CTAs with the longest
    period, with the first role's longest segment in that chunk. own: (role, event) stamped only in a CTA's own
    chunks (the fused walk's warm-up chunks skip it): warm-up chunks are counted."""
    first_events = next(iter(events.values()))
    tops = stamps[:, 0, :, 0].astype(np.float64)
    walked = tops != 0
    chunks = walked.sum(1)
    span = np.array([tops[i, n - 1] - tops[i, 0] if n else 0.0 for i, n in enumerate(chunks)])
    periods = np.where(walked[:, 1:] & walked[:, :-1], tops[:, 1:] - tops[:, :-1], np.nan)
    result = {"chunks": [int(chunks.min()), float(np.median(chunks)), int(chunks.max())],
              "span": [float(span.min()), float(np.median(span)), float(span.max())]}
    if own is not None:
        role, event = own
        owned = stamps[:, list(events).index(role), :, events[role].index(event)] != 0
        warm = (walked & ~owned).sum(1)
        result["warm_up_chunks"] = [int(warm.min()), float(np.median(warm)), int(warm.max())]
    if np.isnan(periods).all():
        return result
    result["period_percentiles"] = dict(zip(("5", "25", "50", "75", "95", "99"),
                                            np.nanpercentile(periods, [5, 25, 50, 75, 95, 99]).tolist()))
    by_index = [float(np.nanmedian(column)) for column in periods.T if not np.isnan(column).all()]
    result["median_period_by_chunk"] = by_index
    filled = np.where(np.isnan(periods), -np.inf, periods)
    longest = np.nan_to_num(filled.max(1), neginf=0)  # 0 for a CTA that walked one chunk
    slowest = []
    for cta in np.argsort(-longest)[:4]:
        chunk = int(filled[cta].argmax())
        segments = np.diff(stamps[cta, 0, chunk, :len(first_events)].astype(np.float64))
        worst = int(np.argmax(segments))
        slowest.append({"cta": int(cta), "chunks": int(chunks[cta]), "chunk": chunk, "period": float(longest[cta]),
                        "segment": f"{first_events[worst]} -> {first_events[worst + 1]}",
                        "segment_cycles": float(segments[worst])})
    result["slowest"] = slowest
    return result


def format_spread(result: dict) -> list[str]:
    def triple(name):
        low, middle, high = result[name]
        return f"min {low:.0f} median {middle:.0f} max {high:.0f}"

    lines = [f"chunks a CTA: {triple('chunks')}; first to last top: {triple('span')} cycles"]
    if "warm_up_chunks" in result:
        lines.append(f"warm-up chunks a CTA: {triple('warm_up_chunks')}")
    if "period_percentiles" in result:
        lines.append("chunk period percentiles: " + ", ".join(f"{p}% {v:.0f}"
                                                               for p, v in result["period_percentiles"].items()))
        lines.append("median period by chunk: " + " ".join(f"{v:.0f}" for v in result["median_period_by_chunk"]))
        lines += [f"slow CTA {s['cta']} ({s['chunks']} chunks): {s['period']:.0f} cycles at chunk {s['chunk']}, "
                  f"most in {s['segment']} {s['segment_cycles']:.0f}" for s in result["slowest"]]
    return lines


def format_summary(summary: dict) -> list[str]:
    period = summary["period"]
    lines = [f"chunk period (state warpgroup, top to top): {period:.0f} cycles"]
    for role, segments in summary.items():
        if role == "period":
            continue
        lines.append(f"{role}: " + ", ".join(f"{label} {cycles:.0f} ({cycles / period:.0%})"
                                             for label, cycles in segments))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="16/64", help="qk heads / value heads")
    parser.add_argument("--lengths", default="32768", help="comma-separated sequence lengths")
    parser.add_argument("--keep", choices=("everything", "nothing"), default="everything",
                        help="what the walk stores: everything (the model's forward) or nothing (the bench's)")
    parser.add_argument("--skip", type=int, default=4, help="first chunks of every CTA left out")
    parser.add_argument("--option", action="append", default=[],
                        help="a keyword of fused_forward (with --backward: of backward.backward) to set True (a "
                             "candidate's switch); repeatable")
    parser.add_argument("--backward", action="store_true",
                        help="the fused reverse walk (flashqla/hopper/backward_fused.py) instead of the forward's")
    parser.add_argument("--model", action="store_true", help="with --backward: the op as the model calls it (L2 norm)")
    parser.add_argument("--spread", action="store_true",
                        help="also how chunk periods spread over CTAs and chunks (the slowest CTAs); with --backward "
                             "the fused walk timed three times in this process")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    options = dict.fromkeys(args.option, True)
    if args.backward:
        return backward_timeline(args, options)

    import torch

    from flashqla.bench import forward_walk_on
    from flashqla.hopper.fused_forward import TIMELINE_EVENTS, timeline_shape

    heads = tuple(int(h) for h in args.heads.split("/"))
    walk, plan = forward_walk_on(heads, [int(n) for n in args.lengths.split(",")])
    store = args.keep == "everything"

    def run(timeline=None):
        return walk(store, timeline=timeline, **options)

    stamps = torch.zeros(timeline_shape(plan.pieces.shape[0], heads[1], plan.value_block), dtype=torch.int64,
                         device=plan.pieces.device)
    record_and_report(run, stamps, lambda plain, recorded: torch.equal(plain[0], recorded[0]), TIMELINE_EVENTS,
                      f"{args.heads} x {args.lengths}, storing {args.keep}, V block {plan.value_block}, "
                      f"{stamps.shape[0]} CTAs", args)


def record_and_report(run, stamps, same_outputs, events, header: str, args, own: tuple[str, str] | None = None):
    """Runs the walk plainly and recording into stamps (a first recording run compiles its kernel), raises where
    same_outputs(plain, recorded) says the recording changed the outputs, then prints (and with --json writes) the
    summary of the stamps under header (and the --option names), and with --spread how periods spread over CTAs and
    chunks (own: as `spread`'s)."""
    import torch

    plain = run()
    run(stamps)  # compiles the recording kernel
    stamps.zero_()
    recorded = run(stamps)
    torch.cuda.synchronize()
    if not same_outputs(plain, recorded):
        raise AssertionError("the recording walk's outputs differ from the walk's")
    clocks = stamps.cpu().numpy()
    summary = summarize(clocks, events, args.skip)
    print(header + "".join(f", {name}" for name in args.option))
    print("\n".join(format_summary(summary)))
    if args.spread:
        summary["spread"] = spread(clocks, events, own)
        print("\n".join(format_spread(summary["spread"])))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


def backward_timeline(args, options: dict) -> None:
    """The fused reverse walk's timeline on the bench's inputs from the forward's kept tensors; its chunk period is
    the state role's (one chunk of the state gradient's chain)."""
    import torch

    from flashqla.bench import _median_ms, kept_backward_on
    from flashqla.hopper.backward_fused import TIMELINE_EVENTS, timeline_shape
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK

    heads = tuple(int(h) for h in args.heads.split("/"))
    seq_lens = [int(n) for n in args.lengths.split(",")]
    backward_on = kept_backward_on(heads, seq_lens, like_the_model=args.model)

    def run(timeline=None):
        return backward_on(timeline, **options)

    bounds = [0, *itertools.accumulate(seq_lens)]
    pieces = plan_forward(torch.tensor(bounds, device="cuda"), heads[1], 128, device_sm_count("cuda"), MAX_VALUE_BLOCK,
                          host_bounds=bounds).pieces
    stamps = torch.zeros(timeline_shape(pieces.shape[0], heads[1]), dtype=torch.int64, device="cuda")
    times = ""
    if args.spread:  # does the fused walk's time move between runs of one process?
        run()
        fused = [_median_ms(run, 30) for _ in range(3)]
        times = f"; fused {', '.join(f'{t:.3f}' for t in fused)} ms"
    record_and_report(run, stamps,
                      lambda plain, recorded: all(torch.equal(a, b) for a, b in zip(plain, recorded)), TIMELINE_EVENTS,
                      f"backward {args.heads} x {args.lengths}{' (the model)' if args.model else ''}, "
                      f"{stamps.shape[0]} CTAs{times}", args, own=("delta", "delta"))


if __name__ == "__main__":
    main()
