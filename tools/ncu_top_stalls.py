"""The SASS instructions (or CUDA lines) of one Nsight Compute report that stall most, from its source
page as CSV.

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > page.csv
    python tools/ncu_top_stalls.py page.csv [--top 40]
    ncu -i REPORT.ncu-rep --page source --print-source cuda --csv > lines.csv   # collected with --import-source yes
    python tools/ncu_top_stalls.py lines.csv --cuda

Prints the instructions with the most warp-stall samples (address, SASS, samples, share of all
samples, executed instructions) and the same samples summed by opcode, so that a kernel's hot spots
can be read from a device log without the Nsight Compute UI. With --cuda the rows are lines of the
generated CUDA (TileLang compiles with -lineinfo), which say which role's loop a wait belongs to; no
opcode sums then.
"""
import argparse
import csv
import io
from collections import Counter


def _column(header: list[str], *needles: str) -> int | None:
    """Index of the first column whose name contains every needle (case-insensitive), else None."""
    for i, name in enumerate(header):
        if all(n.lower() in name.lower() for n in needles):
            return i
    return None


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", help="the CSV that `ncu --page source --print-source sass --csv` wrote")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cuda", action="store_true", help="the page holds CUDA source lines, not SASS")
    args = parser.parse_args(argv)
    text = open(args.page, encoding="utf-8", errors="replace").read()
    # ncu may print lines before the table: start at the first line that looks like its header
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), 0)
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        raise SystemExit(f"{args.page}: no table")
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    source = _column(header, "source")
    address = _column(header, "line") if args.cuda else _column(header, "address")
    samples = _column(header, "stall sampling", "all") or _column(header, "sampling")
    executed = _column(header, "instructions executed")
    if source is None or samples is None:
        raise SystemExit(f"{args.page}: expected Source and stall-sampling columns, got {header}")
    total = sum(_number(r[samples]) for r in body) or 1.0
    print(f"{len(body)} {'CUDA lines' if args.cuda else 'SASS instructions'}, {total:.0f} stall samples")
    ranked = sorted(body, key=lambda r: _number(r[samples]), reverse=True)[:args.top]
    for r in ranked:
        share = 100 * _number(r[samples]) / total
        where = r[address] if address is not None else ""
        ran = f" executed {r[executed]}" if executed is not None else ""
        print(f"{share:5.1f}%  {_number(r[samples]):8.0f}  {where:>8}  {r[source].strip()[:90]}{ran}")
    if args.cuda:
        return
    by_opcode = Counter()
    for r in body:
        opcode = r[source].strip().split(" ")[0].split(".")[0] if r[source].strip() else "?"
        if opcode.startswith("@"):  # a predicate guard: the opcode follows it
            parts = r[source].strip().split()
            opcode = parts[1].split(".")[0] if len(parts) > 1 else opcode
        by_opcode[opcode] += _number(r[samples])
    print("by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_opcode.most_common(15)))


if __name__ == "__main__":
    main()
