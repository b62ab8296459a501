"""The public op: `chunk_gated_delta_rule` and its input checks.

The signature and semantics follow FLA's and FlashQLA's function of the same name, so either can
be swapped for this one. Which implementation runs is decided by `flashqla/backends.py`.
"""
from __future__ import annotations

from numbers import Real

import torch

from flashqla import backends

# What the "tilelang" forward may keep for its backward: everything, all but the chunk states, nothing.
KEEP_FOR_BACKWARD = (True, "inverse", False)


def is_keep_for_backward(value) -> bool:
    """Whether value is one of KEEP_FOR_BACKWARD (1 and 0 are not: they compare equal to True, False)."""
    return isinstance(value, (bool, str)) and value in KEEP_FOR_BACKWARD


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
    keep_for_backward: bool | str = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (docs/gdn-math.md).

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
        backend: "auto" | "tilelang" | "torch" | "fla" (flashqla/backends.py): "tilelang" is the
            Hopper (SM90) kernels, K = V = 128, bfloat16/float16; "torch" the chunked reference,
            any device and dtype; "fla" fla-core's kernels, the baseline; "auto" the first of
            "tilelang", "torch" that takes the inputs (with a one-time warning when it passes
            over the kernels on a Hopper GPU).
        keep_for_backward: when autograd will differentiate the call, what the "tilelang" backend's
            forward keeps for the backward beside the inputs (KEEP_FOR_BACKWARD): True what the
            backward reads of it, gamma, the inverse and the state entering every 64-token chunk
            (about T * Hv * 644 bytes), so that the backward recomputes none of them; "inverse" all
            but the chunk states (gamma and the inverse, about T * Hv * 132 bytes), which the backward
            then rebuilds by walking the chunks again; False nothing (the backward runs the forward
            again), where memory is tighter than time. Under a non-reentrant checkpoint both passes
            see the same value, so they save the same tensors. The other backends ignore it.

    Returns:
        `(o, final_state)`: o shaped and typed like v; final_state or None.
    """
    if not is_keep_for_backward(keep_for_backward):
        raise ValueError(f"keep_for_backward must be one of {KEEP_FOR_BACKWARD}, got {keep_for_backward!r}")
    cu_seqlens_host = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    chosen = backends.select(backend, q, v)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return chosen.run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      cu_seqlens, cu_seqlens_host, keep_for_backward)


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
