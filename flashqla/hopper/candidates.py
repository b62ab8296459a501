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
# defaults after the H200 run of 2026-11-30.
# keep_forward: the autograd Function saves the forward's gamma, A~, Ab, P and the state entering
# every chunk (hopper.KeptForward, about T * Hv * 900 bytes: 1.9 GB for 64 value heads x 32768 tokens),
# so the backward skips the cumsum, the inverse, the products and the chunk-state walk (about 4.4 ms of
# 14.3 on 16/64 x 32768 by the stage times); not yet run on a GPU.
NAMES: tuple[str, ...] = ("keep_forward",)
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
