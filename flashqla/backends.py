"""Which implementation runs `flashqla.chunk_gated_delta_rule`: the one place that decides.

Modelled on fla-core's backend registry: every backend has a verifier that answers `(ok, reason)`
for the call's inputs, a priority, and its runner. `select(name, q, v)` decides from the call's
arguments only (nothing is read from the environment or from process-wide switches):

- a backend named explicitly runs, or its verifier's reason is raised as a ValueError;
- "auto" runs the backend of lowest priority whose verifier accepts the inputs, warning once per
  reason when a faster backend this machine offers had to be passed over for these inputs.

Backends:

- "tilelang" (priority 0): the Hopper kernels (`flashqla.hopper`); an SM90 GPU, tilelang,
  K = V = 128, bfloat16 or float16 q/k/v.
- "torch" (priority 1): the chunked reference (`flashqla.reference`), any device and dtype.
- "fla": fla-core's kernels (`flashqla.fla_baseline`), the baseline; only when named.

Only kernels verified on the GPU grid are reachable from here.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashqla import reference
from flashqla.fla_baseline import chunk_gated_delta_rule_fla
from flashqla.hopper.autograd import chunk_gated_delta_rule_hopper  # imports the kernels only when run
from flashqla.hopper.common import unsupported_inputs

Runner = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Backend:
    """One implementation of the op.

    unavailable(device): what this machine lacks for it on `device` (a phrase), or None.
    unsupported(q, v): what of these inputs it cannot take (a phrase), or None.
    run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        cu_seqlens, cu_seqlens_host, keep_for_backward): (o, final_state) for checked inputs
        (scale resolved, cu_seqlens_host the offsets as a list or None).
    priority: the order in which "auto" tries backends, lowest first; None: only when named.
    """

    name: str
    priority: int | None
    unavailable: Callable[[torch.device], str | None]
    unsupported: Callable[[torch.Tensor, torch.Tensor], str | None]
    run: Runner

    def verify(self, q: torch.Tensor, v: torch.Tensor) -> tuple[bool, str | None]:
        """(ok, reason): whether this backend can run a call with these inputs, and why not."""
        reason = self.unavailable(q.device) or self.unsupported(q, v)
        return reason is None, reason


@functools.cache
def _module_missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def _needs_cuda(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"needs a CUDA GPU, got device {device}"


def hopper_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return _needs_cuda(device)
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"needs an SM90 (Hopper) GPU, {device} is SM{capability[0]}{capability[1]}"
    if _module_missing("tilelang"):
        return "needs the tilelang package, which is not installed"
    return None


def _fla_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return _needs_cuda(device)
    if _module_missing("fla"):
        return "needs fla-core (pip install 'flashqla-hybrid[baseline]'), which is not installed"
    return None


def _takes_anything(q: torch.Tensor, v: torch.Tensor) -> str | None:
    return None


def _runs_anywhere(device: torch.device) -> str | None:
    return None


def _run_torch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               cu_seqlens, cu_seqlens_host, keep_for_backward):
    """The reference in the runner's signature (it plans nothing from host offsets and keeps nothing)."""
    return reference.chunk_gated_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                  use_qk_l2norm_in_kernel, cu_seqlens)


REGISTRY: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("tilelang", 0, hopper_unavailable, unsupported_inputs, chunk_gated_delta_rule_hopper),
        Backend("torch", 1, _runs_anywhere, _takes_anything, _run_torch),
        Backend("fla", None, _fla_unavailable, _takes_anything, chunk_gated_delta_rule_fla),
    )
}
# The names the op's `backend` argument takes.
BACKENDS = ("auto", *REGISTRY)
_AUTO_ORDER = sorted((b for b in REGISTRY.values() if b.priority is not None), key=lambda b: b.priority)


def select(name: str, q: torch.Tensor, v: torch.Tensor) -> Backend:
    """The backend that runs a call with these inputs; ValueError where a named one cannot."""
    if name == "auto":
        passed_over = None
        for backend in _AUTO_ORDER:
            ok, reason = backend.verify(q, v)
            if ok:
                if passed_over is not None:
                    _warn_fallback(*passed_over, backend.name)
                return backend
            if passed_over is None and backend.unavailable(q.device) is None:
                passed_over = (backend.name, reason)  # offered here, but not for these inputs
        raise AssertionError("the torch backend accepts every input")
    if name not in REGISTRY:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    backend = REGISTRY[name]
    ok, reason = backend.verify(q, v)
    if not ok:
        raise ValueError(f"backend={name!r} {reason}")
    return backend


@functools.cache
def _warn_fallback(skipped: str, reason: str, chosen: str) -> None:
    warnings.warn(f"flashqla: backend {skipped!r} {reason}; backend='auto' runs {chosen!r} instead"
                  f"{' (much slower)' if chosen == 'torch' else ''}", stacklevel=4)


def backend_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` on this machine, or None when it can (shapes and dtypes
    aside). For callers that want to fail before they start, such as the trainer's preflight."""
    if backend not in BACKENDS:
        return f"expected one of {BACKENDS}"
    if backend == "auto":
        return None
    reason = REGISTRY[backend].unavailable(device)
    return None if reason is None else f"backend {backend!r} {reason}"
