"""The GDN layer's short causal conv + SiLU over packed documents, forward and backward.

y[t, c] = silu(pre[t, c]),  pre[t, c] = sum_s w[c, K-1-s] x[t-s, c] over the lags s < K with
position[t] >= s (a tap never reaches back past the start of t's document). x is [tokens,
channels] (a [B, T, C] batch flattened; the positions restart every row or document).

One thread per channel walks a block of tokens in order and keeps the last K inputs in registers,
so x is read once and y written once (the compiled torch chain it replaces made ~40 passes over
the tensor in the forward, recompute and backward). The backward recomputes pre, and emits
dx[u] once the K upstream gradients dpre[u .. u+K-1] have passed; the weight gradient is summed
per token block into `dw_partial` and over the blocks by the caller, in a fixed order
(deterministic).
"""
import functools

import tilelang.language as T
import torch

from flashqla.hopper.common import compile_for_hopper, dtype_name

_THREADS = 128  # channels per CTA, one per thread
FORWARD_TOKENS = 64  # tokens a thread walks in the forward
BACKWARD_TOKENS = 256  # and in the backward (also the token blocks of dw_partial)


def _silu(z):
    return z / (1.0 + T.exp(-z))


def conv_forward_program(x_dtype: str, kernel_size: int, block_tokens: int = FORWARD_TOKENS):
    num_tokens = T.dynamic("num_tokens")
    channels = T.dynamic("channels")
    K = kernel_size
    f32 = "float32"

    @T.prim_func
    def causal_conv_silu_forward(
        x: T.Tensor((num_tokens, channels), x_dtype),
        weight: T.Tensor((channels, K), f32),
        position: T.Tensor((num_tokens,), "int32"),
        y: T.Tensor((num_tokens, channels), x_dtype),
    ):
        with T.Kernel(T.ceildiv(channels, _THREADS), T.ceildiv(num_tokens, block_tokens),
                      threads=_THREADS) as (block_c, block_t):
            tx = T.get_thread_binding()
            c = block_c * _THREADS + tx
            first = block_t * block_tokens
            taps = T.alloc_local((K,), f32)
            window = T.alloc_local((K,), f32)  # window[j] = x[t - (K-1) + j]
            acc = T.alloc_var(f32)
            if c < channels:
                for s in T.unroll(K, explicit=True):
                    taps[s] = weight[c, s]
                for j in T.unroll(K - 1, explicit=True):
                    token = first - (K - 1) + j
                    window[j] = T.if_then_else(token >= 0, T.cast(x[T.max(token, 0), c], f32), 0.0)
                for i in T.serial(block_tokens):
                    t = first + i
                    if t < num_tokens:
                        window[K - 1] = T.cast(x[t, c], f32)
                        acc = 0.0
                        for s in T.unroll(K, explicit=True):  # lag s: x[t - s] meets tap K-1-s
                            acc = acc + T.if_then_else(position[t] >= s, window[K - 1 - s] * taps[K - 1 - s], 0.0)
                        y[t, c] = T.cast(_silu(acc), x_dtype)
                        for j in T.unroll(K - 1, explicit=True):
                            window[j] = window[j + 1]

    return causal_conv_silu_forward


def conv_backward_program(x_dtype: str, kernel_size: int, block_tokens: int = BACKWARD_TOKENS):
    num_tokens = T.dynamic("num_tokens")
    channels = T.dynamic("channels")
    num_blocks = T.dynamic("num_blocks")
    K = kernel_size
    f32 = "float32"

    @T.prim_func
    def causal_conv_silu_backward(
        x: T.Tensor((num_tokens, channels), x_dtype),
        weight: T.Tensor((channels, K), f32),
        position: T.Tensor((num_tokens,), "int32"),
        dy: T.Tensor((num_tokens, channels), x_dtype),
        dx: T.Tensor((num_tokens, channels), x_dtype),
        dw_partial: T.Tensor((num_blocks, channels, K), f32),
    ):
        with T.Kernel(T.ceildiv(channels, _THREADS), num_blocks, threads=_THREADS) as (block_c, block_t):
            tx = T.get_thread_binding()
            c = block_c * _THREADS + tx
            first = block_t * block_tokens
            taps = T.alloc_local((K,), f32)
            window = T.alloc_local((K,), f32)  # inputs x[t - (K-1) .. t]
            upstream = T.alloc_local((K,), f32)  # dpre[t - (K-1) .. t]
            upstream_position = T.alloc_local((K,), "int32")  # position[t - (K-1) .. t]
            dw = T.alloc_local((K,), f32)
            pre = T.alloc_var(f32)
            grad = T.alloc_var(f32)
            sig = T.alloc_var(f32)
            dpre = T.alloc_var(f32)
            here = T.alloc_var("int32")
            if c < channels:
                for s in T.unroll(K, explicit=True):
                    taps[s] = weight[c, s]
                    dw[s] = 0.0
                    upstream[s] = 0.0
                    upstream_position[s] = 0
                for j in T.unroll(K - 1, explicit=True):
                    token = first - (K - 1) + j
                    window[j] = T.if_then_else(token >= 0, T.cast(x[T.max(token, 0), c], f32), 0.0)
                # tokens past the block feed dx of its last K-1 tokens
                for i in T.serial(block_tokens + K - 1):
                    t = first + i
                    dpre = 0.0
                    here = 0
                    if t < num_tokens:
                        here = position[t]
                        window[K - 1] = T.cast(x[t, c], f32)
                        pre = 0.0
                        for s in T.unroll(K, explicit=True):
                            pre = pre + T.if_then_else(here >= s, window[K - 1 - s] * taps[K - 1 - s], 0.0)
                        sig = 1.0 / (1.0 + T.exp(-pre))
                        dpre = T.cast(dy[t, c], f32) * sig * (1.0 + pre * (1.0 - sig))
                        if i < block_tokens:
                            for s in T.unroll(K, explicit=True):
                                dw[K - 1 - s] = dw[K - 1 - s] + T.if_then_else(
                                    here >= s, dpre * window[K - 1 - s], 0.0)
                        for j in T.unroll(K - 1, explicit=True):
                            window[j] = window[j + 1]
                    for j in T.unroll(K - 1, explicit=True):
                        upstream[j] = upstream[j + 1]
                        upstream_position[j] = upstream_position[j + 1]
                    upstream[K - 1] = dpre
                    upstream_position[K - 1] = here
                    # x[u] fed pre[u + s] through tap K-1-s, where u + s is at least s into its document
                    u = t - (K - 1)
                    if i >= K - 1 and u < num_tokens:
                        grad = 0.0
                        for s in T.unroll(K, explicit=True):
                            grad = grad + T.if_then_else(upstream_position[s] >= s, upstream[s] * taps[K - 1 - s], 0.0)
                        dx[u, c] = T.cast(grad, x_dtype)
                for s in T.unroll(K, explicit=True):
                    dw_partial[block_t, c, s] = dw[s]

    return causal_conv_silu_backward


# --- Candidate (not yet run on a GPU; reachable only through `candidate=` and `bench --compare conv`) ---
# The kernels above issue one 2-byte load of x (and of dy) a token and a thread and wait for it in the
# same iteration: with 56 registers (backward) 1152 threads an SM have ~4.6 KB in flight, and the walk
# runs at ~1 TB/s (docs/kernel-notes.md). These take `lanes` neighbouring channels a thread (one 4-16
# byte load) and keep the loads of the next `depth` tokens in flight in a ring of registers (the token
# loop unrolled by `depth`, the load index clamped so that it needs no branch). Each channel sees the
# same arithmetic in the same order as above. x, dy, dx, y are viewed [tokens, channels / lanes, lanes],
# so that the vector loads are provably aligned.
CANDIDATES = ((2, 4), (4, 2), (4, 4), (8, 2))  # (lanes, depth) that `bench --compare conv` times


@T.macro
def _window_before(window, loaded, x, first, group, kernel_size, lanes):
    """window[v, j] <- x[first - (K-1) + j] of this thread's lanes for j < K-1, zero before token 0."""
    for j in T.unroll(kernel_size - 1, explicit=True):
        token = first - (kernel_size - 1) + j
        for v in T.vectorized(lanes):
            loaded[v] = x[T.max(token, 0), group, v]
        for v in T.unroll(lanes, explicit=True):
            window[v, j] = T.if_then_else(token >= 0, T.cast(loaded[v], "float32"), 0.0)


def conv_forward_lanes_program(x_dtype: str, kernel_size: int, lanes: int, depth: int,
                               block_tokens: int = FORWARD_TOKENS):
    num_tokens = T.dynamic("num_tokens")
    groups = T.dynamic("groups")
    K, V, P = kernel_size, lanes, depth
    f32 = "float32"

    @T.prim_func
    def causal_conv_silu_forward_lanes(
        x: T.Tensor((num_tokens, groups, V), x_dtype),
        weight: T.Tensor((groups, V, K), f32),
        position: T.Tensor((num_tokens,), "int32"),
        y: T.Tensor((num_tokens, groups, V), x_dtype),
    ):
        with T.Kernel(T.ceildiv(groups, _THREADS), T.ceildiv(num_tokens, block_tokens),
                      threads=_THREADS) as (block_c, block_t):
            tx = T.get_thread_binding()
            group = block_c * _THREADS + tx
            first = block_t * block_tokens
            last = num_tokens - 1
            taps = T.alloc_local((V, K), f32)
            window = T.alloc_local((V, K), f32)  # window[v, j] = x[t - (K-1) + j]
            loaded = T.alloc_local((V,), x_dtype)
            ring = T.alloc_local((P, V), x_dtype)  # x of the tokens t .. t + P - 1
            ring_position = T.alloc_local((P,), "int32")
            out = T.alloc_local((V,), x_dtype)
            acc = T.alloc_var(f32)
            here = T.alloc_var("int32")
            if group < groups:
                for v in T.unroll(V, explicit=True):
                    for s in T.unroll(K, explicit=True):
                        taps[v, s] = weight[group, v, s]
                _window_before(window, loaded, x, first, group, K, V)
                for p in T.unroll(P, explicit=True):
                    for v in T.vectorized(V):
                        ring[p, v] = x[T.min(first + p, last), group, v]
                    ring_position[p] = position[T.min(first + p, last)]
                for i0 in T.serial(T.ceildiv(block_tokens, P)):
                    for p in T.unroll(P, explicit=True):
                        t = first + i0 * P + p
                        for v in T.unroll(V, explicit=True):
                            window[v, K - 1] = T.cast(ring[p, v], f32)
                        here = ring_position[p]
                        for v in T.vectorized(V):
                            ring[p, v] = x[T.min(t + P, last), group, v]
                        ring_position[p] = position[T.min(t + P, last)]
                        if i0 * P + p < block_tokens:
                            if t < num_tokens:
                                for v in T.unroll(V, explicit=True):
                                    acc = 0.0
                                    for s in T.unroll(K, explicit=True):  # lag s: x[t - s] meets tap K-1-s
                                        acc = acc + T.if_then_else(here >= s, window[v, K - 1 - s] * taps[v, K - 1 - s],
                                                                   0.0)
                                    out[v] = T.cast(_silu(acc), x_dtype)
                                for v in T.vectorized(V):
                                    y[t, group, v] = out[v]
                        for v in T.unroll(V, explicit=True):
                            for j in T.unroll(K - 1, explicit=True):
                                window[v, j] = window[v, j + 1]

    return causal_conv_silu_forward_lanes


def conv_backward_lanes_program(x_dtype: str, kernel_size: int, lanes: int, depth: int,
                                block_tokens: int = BACKWARD_TOKENS):
    num_tokens = T.dynamic("num_tokens")
    groups = T.dynamic("groups")
    num_blocks = T.dynamic("num_blocks")
    K, V, P = kernel_size, lanes, depth
    steps = block_tokens + K - 1  # tokens past the block feed dx of its last K-1 tokens
    f32 = "float32"

    @T.prim_func
    def causal_conv_silu_backward_lanes(
        x: T.Tensor((num_tokens, groups, V), x_dtype),
        weight: T.Tensor((groups, V, K), f32),
        position: T.Tensor((num_tokens,), "int32"),
        dy: T.Tensor((num_tokens, groups, V), x_dtype),
        dx: T.Tensor((num_tokens, groups, V), x_dtype),
        dw_partial: T.Tensor((num_blocks, groups, V, K), f32),
    ):
        with T.Kernel(T.ceildiv(groups, _THREADS), num_blocks, threads=_THREADS) as (block_c, block_t):
            tx = T.get_thread_binding()
            group = block_c * _THREADS + tx
            first = block_t * block_tokens
            last = num_tokens - 1
            taps = T.alloc_local((V, K), f32)
            window = T.alloc_local((V, K), f32)  # inputs x[t - (K-1) .. t]
            upstream = T.alloc_local((V, K), f32)  # dpre[t - (K-1) .. t]
            upstream_position = T.alloc_local((K,), "int32")  # position[t - (K-1) .. t]
            dw = T.alloc_local((V, K), f32)
            dpre = T.alloc_local((V,), f32)
            loaded = T.alloc_local((V,), x_dtype)  # the window's start
            ring_x = T.alloc_local((P, V), x_dtype)  # x, dy and position of the tokens t .. t + P - 1
            ring_dy = T.alloc_local((P, V), x_dtype)
            ring_position = T.alloc_local((P,), "int32")
            out = T.alloc_local((V,), x_dtype)
            pre = T.alloc_var(f32)
            grad = T.alloc_var(f32)
            sig = T.alloc_var(f32)
            here = T.alloc_var("int32")
            if group < groups:
                for v in T.unroll(V, explicit=True):
                    for s in T.unroll(K, explicit=True):
                        taps[v, s] = weight[group, v, s]
                        dw[v, s] = 0.0
                        upstream[v, s] = 0.0
                for s in T.unroll(K, explicit=True):
                    upstream_position[s] = 0
                _window_before(window, loaded, x, first, group, K, V)
                for p in T.unroll(P, explicit=True):
                    for v in T.vectorized(V):
                        ring_x[p, v] = x[T.min(first + p, last), group, v]
                    for v in T.vectorized(V):
                        ring_dy[p, v] = dy[T.min(first + p, last), group, v]
                    ring_position[p] = position[T.min(first + p, last)]
                for i0 in T.serial(T.ceildiv(steps, P)):
                    for p in T.unroll(P, explicit=True):
                        i = i0 * P + p
                        t = first + i
                        # past the last token the window is neither read nor shifted, and dpre is 0
                        for v in T.unroll(V, explicit=True):
                            window[v, K - 1] = T.cast(ring_x[p, v], f32)
                            dpre[v] = T.if_then_else(t < num_tokens, T.cast(ring_dy[p, v], f32), 0.0)
                        here = T.if_then_else(t < num_tokens, ring_position[p], 0)
                        for v in T.vectorized(V):
                            ring_x[p, v] = x[T.min(t + P, last), group, v]
                        for v in T.vectorized(V):
                            ring_dy[p, v] = dy[T.min(t + P, last), group, v]
                        ring_position[p] = position[T.min(t + P, last)]
                        if i < steps:
                            if t < num_tokens:
                                for v in T.unroll(V, explicit=True):
                                    pre = 0.0
                                    for s in T.unroll(K, explicit=True):
                                        pre = pre + T.if_then_else(here >= s, window[v, K - 1 - s] * taps[v, K - 1 - s], 0.0)
                                    sig = 1.0 / (1.0 + T.exp(-pre))
                                    dpre[v] = dpre[v] * sig * (1.0 + pre * (1.0 - sig))
                                    if i < block_tokens:
                                        for s in T.unroll(K, explicit=True):
                                            dw[v, K - 1 - s] = dw[v, K - 1 - s] + T.if_then_else(
                                                here >= s, dpre[v] * window[v, K - 1 - s], 0.0)
                                    for j in T.unroll(K - 1, explicit=True):
                                        window[v, j] = window[v, j + 1]
                            for j in T.unroll(K - 1, explicit=True):
                                upstream_position[j] = upstream_position[j + 1]
                                for v in T.unroll(V, explicit=True):
                                    upstream[v, j] = upstream[v, j + 1]
                            upstream_position[K - 1] = here
                            for v in T.unroll(V, explicit=True):
                                upstream[v, K - 1] = dpre[v]
                            # x[u] fed pre[u + s] through tap K-1-s, where u + s is at least s into its document
                            u = t - (K - 1)
                            if i >= K - 1 and u < num_tokens:
                                for v in T.unroll(V, explicit=True):
                                    grad = 0.0
                                    for s in T.unroll(K, explicit=True):
                                        grad = grad + T.if_then_else(upstream_position[s] >= s,
                                                                     upstream[v, s] * taps[v, K - 1 - s], 0.0)
                                    out[v] = T.cast(grad, x_dtype)
                                for v in T.vectorized(V):
                                    dx[u, group, v] = out[v]
                for v in T.unroll(V, explicit=True):
                    for s in T.unroll(K, explicit=True):
                        dw_partial[block_t, group, v, s] = dw[v, s]

    return causal_conv_silu_backward_lanes


@functools.lru_cache(maxsize=None)
def compile_conv_forward_lanes(x_dtype: str, kernel_size: int, lanes: int, depth: int):
    return compile_for_hopper(conv_forward_lanes_program(x_dtype, kernel_size, lanes, depth))


@functools.lru_cache(maxsize=None)
def compile_conv_backward_lanes(x_dtype: str, kernel_size: int, lanes: int, depth: int):
    return compile_for_hopper(conv_backward_lanes_program(x_dtype, kernel_size, lanes, depth))


def candidate_unavailable_reason(x: torch.Tensor, candidate: tuple[int, int]) -> str | None:
    """Why x [N, C] cannot take the candidate kernels with candidate = (lanes, depth) (None: it can): C
    must split into whole vectors of at most 16 bytes, x must start on one, depth >= 1."""
    lanes, depth = candidate
    width = lanes * x.element_size()
    if lanes < 1 or lanes & (lanes - 1) or width > 16 or depth < 1:
        return (f"candidate=(lanes={lanes}, depth={depth}): expected lanes a power of two with lanes * "
                f"{x.element_size()} bytes <= 16, and depth >= 1")
    if x.shape[-1] % lanes or x.data_ptr() % width:
        return (f"candidate lanes={lanes}: x has {x.shape[-1]} channels at address {x.data_ptr():#x}, "
                f"not whole {width}-byte vectors")
    return None


@functools.lru_cache(maxsize=None)
def compile_conv_forward(x_dtype: str = "bfloat16", kernel_size: int = 4):
    return compile_for_hopper(conv_forward_program(x_dtype, kernel_size))


@functools.lru_cache(maxsize=None)
def compile_conv_backward(x_dtype: str = "bfloat16", kernel_size: int = 4):
    return compile_for_hopper(conv_backward_program(x_dtype, kernel_size))


def conv_forward(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor,
                 candidate: tuple[int, int] | None = None) -> torch.Tensor:
    """x [N, C] contiguous, weight [C, K] float32 contiguous, position [N] int32 -> y [N, C].
    candidate: (lanes, depth) of the candidate kernels (None: the kernels above)."""
    y = torch.empty_like(x)
    if x.numel():
        if candidate is None:
            compile_conv_forward(dtype_name(x), weight.shape[1])(x, weight, position, y)
        else:
            lanes = candidate[0]
            groups = x.shape[1] // lanes
            kernel = compile_conv_forward_lanes(dtype_name(x), weight.shape[1], *candidate)
            kernel(x.view(-1, groups, lanes), weight.view(groups, lanes, -1), position, y.view(-1, groups, lanes))
    return y


def conv_backward(x, weight, position, dy, candidate: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [N, C] (x's dtype) and dw [C, K] float32 for the forward above."""
    dx = torch.empty_like(x)
    num_blocks = -(-x.shape[0] // BACKWARD_TOKENS)
    dw_partial = torch.empty(num_blocks, *weight.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        if candidate is None:
            compile_conv_backward(dtype_name(x), weight.shape[1])(x, weight, position, dy, dx, dw_partial)
        else:
            lanes = candidate[0]
            if dy.data_ptr() % (lanes * dy.element_size()):
                dy = dy.clone()  # a view off a vector boundary
            groups = x.shape[1] // lanes
            kernel = compile_conv_backward_lanes(dtype_name(x), weight.shape[1], *candidate)
            kernel(x.view(-1, groups, lanes), weight.view(groups, lanes, -1), position, dy.view(-1, groups, lanes),
                   dx.view(-1, groups, lanes), dw_partial.view(num_blocks, groups, lanes, -1))
    return dx, dw_partial.sum(0)


class CausalConvSilu(torch.autograd.Function):
    """Keeps x (and the positions) only: the backward recomputes the conv in registers."""

    @staticmethod
    def forward(ctx, x, weight, position, candidate=None):
        taps = weight.reshape(weight.shape[0], -1).to(torch.float32).contiguous()
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if candidate is not None and (reason := candidate_unavailable_reason(flat, candidate)) is not None:
            raise ValueError(reason)
        ctx.save_for_backward(flat, taps, position)
        ctx.weight_shape, ctx.weight_dtype, ctx.candidate = weight.shape, weight.dtype, candidate
        return conv_forward(flat, taps, position, candidate).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        flat, taps, position = ctx.saved_tensors
        dx, dw = conv_backward(flat, taps, position, dy.reshape(flat.shape).contiguous(), ctx.candidate)
        return dx.view(dy.shape), dw.view(ctx.weight_shape).to(ctx.weight_dtype), None, None


def causal_conv1d_silu_hopper(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor,
                              candidate: tuple[int, int] | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) of x [B, T, C] (bfloat16, float16 or float32) with weight
    [C, 1, K] or [C, K]; position [B * T] int32: each token's position in its document (or row).
    candidate: (lanes, depth) of the candidate kernels (`bench --compare conv` and their GPU test only)."""
    return CausalConvSilu.apply(x, weight, position, candidate)
