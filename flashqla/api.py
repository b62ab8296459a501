"""The public op: `chunk_gated_delta_rule`, its input checks and its backends.

The signature and semantics follow FLA's and FlashQLA's function of the same name, so either can
be swapped for this one. Backends:

- "torch": the chunked reference (`flashqla.reference`), any device and dtype, autograd.
- "tilelang": the Hopper (SM90) TileLang kernels in `flashqla.hopper`, K = V = 128.
- "fla": fla-core's kernels, the baseline (`flashqla.fla_baseline`).
- "auto": "tilelang" for CUDA tensors on an SM90 device with K = V = 128, else "torch".
  The environment variable FLASHQLA_BACKEND, when set, replaces "auto" with its value.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from numbers import Real

import torch

from flashqla import reference

BACKENDS = ("auto", "tilelang", "torch", "fla")
BACKEND_ENV_VAR = "FLASHQLA_BACKEND"
HOPPER_HEAD_DIM = 128
HOPPER_DTYPES = (torch.bfloat16, torch.float16)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t,
    per sequence and value head, with the state restarting at each sequence of `cu_seqlens`.

    Args:
        q, k: `[B, T, Hqk, K]`. v: `[B, T, Hv, V]` with `Hv % Hqk == 0`; value head h reads
            qk head `h // (Hv // Hqk)`.
        g: `[B, T, Hv]` log-space decay (<= 0). beta: `[B, T, Hv]`, in (0, 1).
        scale: multiplies the output; default `K ** -0.5`.
        initial_state: `[N, Hv, K, V]` (N = B, or the number of sequences with `cu_seqlens`).
        output_final_state: also return the state after each sequence, `[N, Hv, K, V]` float32
            (float64 for float64 inputs).
        use_qk_l2norm_in_kernel: L2-normalise q and k over their last dim first.
        cu_seqlens: `[N + 1]` integer offsets of packed sequences (0 first, T last, non-decreasing;
            empty sequences allowed); needs B = 1.
        cu_seqlens_cpu: the same offsets on the CPU (as in FLA). The kernels plan from host offsets;
            given, they are taken from here and the call makes no device->host read. The caller
            guarantees it equals cu_seqlens (that is not checked: it would cost the read it saves).
        backend: "auto" | "tilelang" | "torch" | "fla".

    Returns:
        `(o, final_state)`: o shaped and typed like v; final_state or None.

    Memory: under autograd the "tilelang" backend keeps its forward's intermediates for the backward
    (about T * Hv * 900 bytes, with a state per 64-token chunk among them); `recompute_for_backward()`
    keeps only the inputs instead, for a slower backward.
    """
    cu_seqlens_host = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    backend = resolve_backend(backend, q, v)
    if scale is None:
        scale = q.shape[-1] ** -0.5

    if backend == "torch":
        return reference.chunk_gated_delta_rule_torch(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
        )
    if backend == "fla":
        from flashqla.fla_baseline import chunk_gated_delta_rule_fla

        return chunk_gated_delta_rule_fla(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu if cu_seqlens_cpu is not None or cu_seqlens_host is None
            else torch.tensor(cu_seqlens_host),
        )
    if use_qk_l2norm_in_kernel:
        q, k = reference.l2_normalize(q), reference.l2_normalize(k)
    return HopperGatedDeltaRule.apply(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_host,
        _keep_forward(q, k, v, g, beta, initial_state),
    )


# Depth of recompute_for_backward() blocks open now (process-wide: the autograd engine runs a
# checkpoint's recomputation on its own thread, which must not inherit the first pass's choice).
_recompute_depth = 0


@contextlib.contextmanager
def recompute_for_backward():
    """Within this block the TileLang op saves only its inputs for the backward, which then
    recomputes the rest (gamma, the inverse, the gated products and the state entering every
    chunk). Outside it, a forward that autograd will differentiate keeps them: about
    T * Hv * 900 bytes per call (1.9 GB at 64 value heads x 32768 tokens, or 16 x 131072), for a
    forward + backward 1.33-1.42x faster on the H200.
    Useful when memory is tighter than time. Under a non-reentrant torch checkpoint, open it
    around both passes or neither: the recomputation must save the tensors the first pass saved
    (torch raises CheckpointError otherwise). A reentrant checkpoint's first pass runs without
    grad and keeps nothing anyway."""
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def _keep_forward(*inputs) -> bool:
    """Whether the Hopper forward keeps its intermediates for a backward: only when autograd will
    run one (inside Function.forward grad mode is always off, and needs_input_grad ignores
    no_grad) and no recompute_for_backward() block is open."""
    return (_recompute_depth == 0 and torch.is_grad_enabled()
            and any(x is not None and x.requires_grad for x in inputs))


class HopperGatedDeltaRule(torch.autograd.Function):
    """Autograd for the TileLang kernels. Saves the inputs and, when `keep` (see
    recompute_for_backward), the forward's gamma, A~, Ab, P and chunk states (hopper.KeptForward),
    which the backward then does not recompute."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_host,
                keep=False):
        from flashqla import hopper

        o, final_state, *kept = hopper.forward(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_host=cu_seqlens_host,
            keep_for_backward=keep,
        )
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *(kept[0] if keep else ()))
        ctx.scale = scale
        ctx.cu_seqlens_host = cu_seqlens_host
        ctx.candidates = hopper.candidates.chosen()  # the backward runs the kernels this forward chose
        return o, final_state

    @staticmethod
    def backward(ctx, d_o, d_final_state):
        from flashqla.hopper import KeptForward, candidates
        from flashqla.hopper.backward import backward

        q, k, v, g, beta, initial_state, cu_seqlens, *kept = ctx.saved_tensors
        with candidates.use(*ctx.candidates):
            dq, dk, dv, dg, dbeta, dh0 = backward(
                q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, d_o, d_final_state,
                cu_seqlens_host=ctx.cu_seqlens_host, kept=KeptForward(*kept) if kept else None,
            )
        dh0 = dh0 if initial_state is not None else None
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None


def resolve_backend(backend: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """The concrete backend for these inputs; errors where an explicit choice cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV_VAR, "auto")
        if backend not in BACKENDS:
            raise ValueError(f"environment variable {BACKEND_ENV_VAR} must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not _hopper_available(q.device):
            return "torch"
        if q.shape[-1] != HOPPER_HEAD_DIM or v.shape[-1] != HOPPER_HEAD_DIM:
            _warn_fallback(f"the TileLang kernels support K = V = {HOPPER_HEAD_DIM}, got K={q.shape[-1]}, V={v.shape[-1]}")
            return "torch"
        if q.dtype not in HOPPER_DTYPES:
            _warn_fallback(f"the TileLang kernels take bfloat16 or float16 q/k/v, got {q.dtype}")
            return "torch"
        return "tilelang"
    if backend == "tilelang":
        if not _hopper_available(q.device):
            raise ValueError(
                f"backend='tilelang' needs CUDA tensors on an SM90 (Hopper) GPU with tilelang installed; "
                f"got tensors on {q.device}"
            )
        if q.shape[-1] != HOPPER_HEAD_DIM or v.shape[-1] != HOPPER_HEAD_DIM:
            raise ValueError(
                f"backend='tilelang' supports K = V = {HOPPER_HEAD_DIM}, got K={q.shape[-1]}, V={v.shape[-1]}; "
                f"use backend='torch' or 'auto' for other head dims"
            )
    return backend


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"flashqla: {reason}; backend='auto' falls back to the torch path (much slower)", stacklevel=4)


def backend_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` on this machine, or None when it can (shapes and dtypes
    aside). For callers that want to fail before they start, such as the trainer's preflight."""
    if backend not in BACKENDS:
        return f"expected one of {BACKENDS}"
    if backend in ("auto", "torch"):
        return None
    if device.type != "cuda":
        return f"backend {backend!r} needs a CUDA GPU, this machine runs on {device}"
    if backend == "tilelang":
        if torch.cuda.get_device_capability(device) != (9, 0):
            return f"backend 'tilelang' needs an SM90 (Hopper) GPU, {device} is SM{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        if not _importable("tilelang"):
            return "backend 'tilelang' needs the tilelang package, which is not installed"
    if backend == "fla" and not _importable("fla"):
        return "backend 'fla' needs fla-core (pip install 'flashqla-hybrid[baseline]'), which is not installed"
    return None


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _hopper_available(device: torch.device) -> bool:
    return backend_unavailable_reason("tilelang", device) is None


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu=None) -> list[int] | None:
    """Raise TypeError/ValueError naming the argument for anything outside the contract.

    Returns cu_seqlens as a host list (the kernels plan their grid from it), or None: taken from
    cu_seqlens_cpu when given, else read back from cu_seqlens."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() != rank:
            expected = "[B, T, H, D]" if rank == 4 else "[B, T, Hv]"
            raise ValueError(f"{name} must have rank {rank} {expected}, got shape {tuple(x.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, Hqk, K], got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, Hv, V] with q's B, T = {tuple(q.shape[:2])}, got shape {tuple(v.shape)}")
    B, T, num_qk_heads, _ = q.shape
    num_v_heads = v.shape[2]
    if num_qk_heads == 0 or num_v_heads % num_qk_heads != 0:
        raise ValueError(
            f"v's head count Hv={num_v_heads} must be a positive multiple of q/k's head count Hqk={num_qk_heads}"
        )
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(f"{name} must be [B, T, Hv] = {tuple(v.shape[:3])}, got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real) or not scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")

    num_sequences, bounds = B, None
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens; pass both (the same offsets) or neither")
        if not isinstance(cu_seqlens_cpu, torch.Tensor):
            raise TypeError(f"cu_seqlens_cpu must be an integer torch.Tensor on the CPU, got {type(cu_seqlens_cpu).__name__}")
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be an integer tensor on the CPU, got one on {cu_seqlens_cpu.device}")
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {tuple(cu_seqlens.shape)}, "
                             f"got {tuple(cu_seqlens_cpu.shape)}")
    if cu_seqlens is not None:
        bounds = _check_cu_seqlens(cu_seqlens, B, T, q.device, host_copy=cu_seqlens_cpu)
        num_sequences = len(bounds) - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating-point tensor, got {initial_state!r:.80}")
        expected = (num_sequences, num_v_heads, q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must be [N, Hv, K, V] = {expected} (N = "
                f"{'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'}), got shape {tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return bounds


def _check_cu_seqlens(cu_seqlens, batch: int, seq_len: int, device: torch.device, host_copy=None) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs packed inputs with B = 1, got B = {batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if host_copy is not None and host_copy.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens_cpu must have dtype int32 or int64, got {host_copy.dtype}")
    # the bounds are read from the host copy when there is one, so errors name it
    name, bounds = ("cu_seqlens", cu_seqlens.tolist()) if host_copy is None else ("cu_seqlens_cpu", host_copy.tolist())
    if bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(
            f"{name} must start at 0 and end at T = {seq_len}, got first {bounds[0]} and last {bounds[-1]}"
        )
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {bounds if len(bounds) <= 16 else bounds[:16] + ['...']}")
    return bounds
