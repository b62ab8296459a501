"""Candidate kernels: in the tree beside the device-verified kernels they may replace, off by default.

A candidate becomes the default only after a device run shows it correct and faster; until then
the forward and backward ask `enabled(name)`. Turn candidates on for a process with
FLASHQLA_CANDIDATES=name,name, or for a block with `use(...)` (the bench
times both sides in one run). The autograd Function records the choice at forward time so the
backward of that call uses the same kernels.
"""
from __future__ import annotations

import contextlib
import os

# grouped_products and the persistent chunk-gradient kernel (backward_chunk_grads.py) became the
# defaults after the H200 run of 2026-11-30, and so did keep_forward (the forward keeps what the
# backward would recompute: forward + backward 1.33x faster on 16/64 x 32768, 1.42x on 2/8;
# flashqla.recompute_for_backward() turns it off).
# backward_pieces: the state-gradient walk runs in the forward plan's pieces, each CTA starting from
# a decay-truncated warm-up after its piece (chunk_plan.walk_ends), instead of one CTA per whole
# sequence; for 16/16 heads x 131072 tokens 128 CTAs over ~516 chunks instead of 64 over 2048
# (about 6 -> 1.6 ms a layer predicted). Compiled for sm_90a; not yet run on a GPU.
NAMES: tuple[str, ...] = ("backward_pieces",)
ENV_VAR = "FLASHQLA_CANDIDATES"
_chosen: tuple[str, ...] | None = None  # set by use(); None: read the environment


def _checked(names) -> tuple[str, ...]:
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown kernel candidate(s) {unknown}; expected names from {NAMES}")
    return tuple(names)


def chosen() -> tuple[str, ...]:
    """The candidates in use now."""
    if _chosen is not None:
        return _chosen
    raw = os.environ.get(ENV_VAR, "")
    try:
        return _checked([n.strip() for n in raw.split(",") if n.strip()])
    except ValueError as error:
        raise ValueError(f"environment variable {ENV_VAR}={raw!r}: {error}") from None


def enabled(name: str) -> bool:
    return name in chosen()


@contextlib.contextmanager
def use(*names: str):
    """Within the block exactly these candidates are on (none when called without names)."""
    global _chosen
    previous, _chosen = _chosen, _checked(names)
    try:
        yield
    finally:
        _chosen = previous
