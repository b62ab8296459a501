"""The q/k L2 normalisation of `use_qk_l2norm_in_kernel` as two memory-bound kernels.

y = x * r with r = (sum(x^2) + eps)^(-1/2) over the last dim, in float32 and rounded once; its
gradient dx = r * (dy - y * sum(y * dy)), which needs x and r (4 bytes a row): y is made again from them,
the same bits. The op makes r inside the inverse's kernel (inverse.py, normalize_qk, the same arithmetic
and bits) and never writes y: the forward here is its reference and the bench's unfused stage. The
backward runs here after the fused reverse walk, summing each head group's gradients as it reads them
(backward.py; `norm_in_fused_walk`, a candidate, applies it inside the walk where Hv = Hqk).

Rows of 128 elements; 16 threads a row, each with 8 neighbouring elements (one 16-byte load), so a
warp reads two whole rows per instruction and a row's sum is four xor-shuffles inside its 16 lanes.
A thread loads its rows of all passes before it reduces any, so the loads of a CTA are in flight
together. torch.compile's version of the same math ran at ~1.7 TB/s on the H200 (1.27 ms for q and
k of 16 heads x 131072 tokens, docs/performance.md, twelfth session).
"""
import functools

import tilelang.language as T
import torch

from flashqla.hopper.common import HEAD_DIM, compile_for_hopper, dtype_name

EPS = 1e-6  # as HF Qwen3.5's torch path and FLA's kernels
_VECTOR = 8  # elements a thread loads at once (16 bytes of bf16 / fp16)
_LANES = HEAD_DIM // _VECTOR  # threads a row
_THREADS = 256
_PASSES = 4  # rows a thread takes part in
ROWS_PER_CTA = _THREADS // _LANES * _PASSES


@T.macro
def _load_row(values, source, p, first, col, rows, step):
    """values[p] <- this thread's 8 elements of its pass-p row of source, in float32; rows past the
    end read the last row (every lane must take part in the shuffles)."""
    for j in T.vectorized(_VECTOR):
        values[p, j] = T.cast(source[T.min(first + p * step, rows - 1), col + j], "float32")


@T.macro
def _row_sum(partial, p):
    """partial[p] becomes its sum over the 16 lanes of this thread's row, in every one of them."""
    for o in T.unroll(4):
        partial[p] = partial[p] + T.shfl_xor(partial[p], (_LANES // 2) >> o)


def l2norm_forward_program(dtype: str, eps: float):
    rows = T.dynamic("rows")
    f32 = "float32"
    step = _THREADS // _LANES

    @T.prim_func
    def l2norm_forward(
        x: T.Tensor((rows, HEAD_DIM), dtype),
        y: T.Tensor((rows, HEAD_DIM), dtype),
        rstd: T.Tensor((rows,), f32),
    ):
        with T.Kernel(T.ceildiv(rows, ROWS_PER_CTA), threads=_THREADS) as block:
            tx = T.get_thread_binding()
            col = (tx % _LANES) * _VECTOR
            first = block * ROWS_PER_CTA + tx // _LANES
            values = T.alloc_local((_PASSES, _VECTOR), f32)
            scale = T.alloc_local((_PASSES,), f32)
            for p in T.unroll(_PASSES):
                _load_row(values, x, p, first, col, rows, step)
            for p in T.unroll(_PASSES):
                scale[p] = 0.0
                for j in T.unroll(_VECTOR):
                    scale[p] = scale[p] + values[p, j] * values[p, j]
                _row_sum(scale, p)
                scale[p] = T.rsqrt(scale[p] + eps)
            for p in T.unroll(_PASSES):
                if first + p * step < rows:
                    for j in T.vectorized(_VECTOR):
                        y[first + p * step, col + j] = T.cast(values[p, j] * scale[p], dtype)
                    if tx % _LANES == 0:
                        rstd[first + p * step] = scale[p]

    return l2norm_forward


def l2norm_backward_program(dtype: str, grad_dtype: str):
    """dy holds `group` rows for each row of x (run-time, >= 1: a head group's value heads, row r's at
    r * group ...), in grad_dtype; they are summed in float32, in order, before the norm's backward, so a
    grouped layout's gradient is read once and rounded once."""
    rows = T.dynamic("rows")
    grad_rows = T.dynamic("grad_rows")
    f32 = "float32"
    step = _THREADS // _LANES

    @T.prim_func
    def l2norm_backward(
        dy: T.Tensor((grad_rows, HEAD_DIM), grad_dtype),
        x: T.Tensor((rows, HEAD_DIM), dtype),
        rstd: T.Tensor((rows,), f32),
        dx: T.Tensor((rows, HEAD_DIM), dtype),
        group: T.int32,
    ):
        with T.Kernel(T.ceildiv(rows, ROWS_PER_CTA), threads=_THREADS) as block:
            tx = T.get_thread_binding()
            col = (tx % _LANES) * _VECTOR
            first = block * ROWS_PER_CTA + tx // _LANES
            upstream = T.alloc_local((_PASSES, _VECTOR), f32)
            normalised = T.alloc_local((_PASSES, _VECTOR), f32)
            row_rstd = T.alloc_local((_PASSES,), f32)
            dot = T.alloc_local((_PASSES,), f32)
            member = T.alloc_local((_PASSES, _VECTOR), f32)
            for p in T.unroll(_PASSES):
                _load_row(normalised, x, p, first, col, rows, step)
                row_rstd[p] = rstd[T.min(first + p * step, rows - 1)]
                for j in T.unroll(_VECTOR):
                    upstream[p, j] = 0.0
            for m in T.serial(group):  # each member's rows of all passes in flight together
                for p in T.unroll(_PASSES):
                    for j in T.vectorized(_VECTOR):
                        member[p, j] = T.cast(dy[T.min(first + p * step, rows - 1) * group + m, col + j], f32)
                for p in T.unroll(_PASSES):
                    for j in T.unroll(_VECTOR):
                        upstream[p, j] = upstream[p, j] + member[p, j]
            for p in T.unroll(_PASSES):  # y = x r rounded as the forward rounds it
                for j in T.unroll(_VECTOR):
                    normalised[p, j] = T.cast(T.cast(normalised[p, j] * row_rstd[p], dtype), f32)
            for p in T.unroll(_PASSES):
                dot[p] = 0.0
                for j in T.unroll(_VECTOR):
                    dot[p] = dot[p] + normalised[p, j] * upstream[p, j]
                _row_sum(dot, p)
            for p in T.unroll(_PASSES):
                if first + p * step < rows:
                    for j in T.vectorized(_VECTOR):
                        dx[first + p * step, col + j] = T.cast(
                            row_rstd[p] * (upstream[p, j] - normalised[p, j] * dot[p]), dtype)

    return l2norm_backward


@functools.lru_cache(maxsize=None)
def compile_l2norm_forward(dtype: str = "bfloat16", eps: float = EPS):
    return compile_for_hopper(l2norm_forward_program(dtype, eps))


@functools.lru_cache(maxsize=None)
def compile_l2norm_backward(dtype: str = "bfloat16", grad_dtype: str | None = None):
    return compile_for_hopper(l2norm_backward_program(dtype, grad_dtype or dtype))


def l2norm_forward(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of x [rows, 128] contiguous bf16 / fp16: y in x's dtype, rstd float32 [rows]."""
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        compile_l2norm_forward(dtype_name(x), eps)(x, y, rstd)
    return y, rstd


def l2norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx [rows, 128] in x's dtype for the forward above, from its input x and r, and the sum of G >= 1
    gradients of each row (a head group's value heads; G = 1 for a plain norm), summed as they are read:
    dy [rows * G, 128] contiguous, bf16 or x's dtype, row r's G at r * G ...; x contiguous."""
    rows = x.shape[0]
    if dy.shape[0] % max(rows, 1) != 0 or (rows == 0) != (dy.shape[0] == 0):
        raise ValueError(f"l2norm_backward: dy must have a whole number of rows per row of x ({rows}), "
                         f"got {dy.shape[0]}")
    dx = torch.empty_like(x)
    if rows:
        compile_l2norm_backward(dtype_name(x), dtype_name(dy))(dy, x, rstd, dx, dy.shape[0] // rows)
    return dx


def l2_normalized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype and shape; its r, float32 [rows])."""
    y, rstd = l2norm_forward(x.reshape(-1, x.shape[-1]), EPS)
    return y.view(x.shape), rstd
