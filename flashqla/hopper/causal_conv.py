"""The GDN layer's short causal conv + SiLU over packed documents, forward and backward.

y[t, c] = silu(pre[t, c]),  pre[t, c] = sum_s w[c, K-1-s] x[t-s, c] over the lags s < K with
position[t] >= s (a tap never reaches back past the start of t's document). x is [tokens,
channels] (a [B, T, C] batch flattened; the positions restart every row or document).

A thread takes `lanes` neighbouring channels (one vector load of up to 16 bytes a token, 8 for bf16
and fp16) and walks a block of tokens in order, keeping the last K inputs in registers and the loads
of the next `DEPTH` tokens in flight in a ring of registers (the token loop unrolled by DEPTH, the
load index clamped so that it needs no branch). x is read once and y written once (the compiled
torch chain it replaced made ~40 passes over the tensor in the forward, recompute and backward). The backward recomputes pre,
and emits dx[u] once the K upstream gradients dpre[u .. u+K-1] have passed; the weight gradient is
summed per token block into `dw_partial` and over the blocks by the caller, in a fixed order
(deterministic). Every channel sees the same arithmetic in the same order whatever its lanes, so the
outputs do not depend on the vector width (tests/flashqla/test_causal_conv.py checks it bitwise on
the host). x, dy, dx, y are viewed [tokens, channels / lanes, lanes], so that the vector loads are
provably aligned. Measured against one channel a thread and other widths: docs/kernel-notes.md.
"""
import functools

import tilelang.language as T
import torch

from flashqla.hopper.common import compile_for_hopper, dtype_name

_THREADS = 128  # lane groups per CTA, one per thread
FORWARD_TOKENS = 64  # tokens a thread walks in the forward
BACKWARD_TOKENS = 256  # and in the backward (also the token blocks of dw_partial)
MAX_LANES = 4  # channels a thread: 4 beat 2 and 8 at 32768-131072 tokens on the H200
DEPTH = 2  # tokens whose loads are in flight ahead of the one computed: 2 beat 4


def _silu(z):
    return z / (1.0 + T.exp(-z))


@T.macro
def _window_before(window, loaded, x, first, group, kernel_size, lanes):
    """window[v, j] <- x[first - (K-1) + j] of this thread's lanes for j < K-1, zero before token 0."""
    for j in T.unroll(kernel_size - 1, explicit=True):
        token = first - (kernel_size - 1) + j
        for v in T.vectorized(lanes):
            loaded[v] = x[T.max(token, 0), group, v]
        for v in T.unroll(lanes, explicit=True):
            window[v, j] = T.if_then_else(token >= 0, T.cast(loaded[v], "float32"), 0.0)


def conv_forward_program(x_dtype: str, kernel_size: int, lanes: int, depth: int = DEPTH,
                         block_tokens: int = FORWARD_TOKENS):
    num_tokens = T.dynamic("num_tokens")
    groups = T.dynamic("groups")
    K, V, P = kernel_size, lanes, depth
    f32 = "float32"

    @T.prim_func
    def causal_conv_silu_forward(
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

    return causal_conv_silu_forward


def conv_backward_program(x_dtype: str, kernel_size: int, lanes: int, depth: int = DEPTH,
                          block_tokens: int = BACKWARD_TOKENS):
    num_tokens = T.dynamic("num_tokens")
    groups = T.dynamic("groups")
    num_blocks = T.dynamic("num_blocks")
    K, V, P = kernel_size, lanes, depth
    steps = block_tokens + K - 1  # tokens past the block feed dx of its last K-1 tokens
    f32 = "float32"

    @T.prim_func
    def causal_conv_silu_backward(
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

    return causal_conv_silu_backward


def compile_conv_forward(x_dtype: str = "bfloat16", kernel_size: int = 4, lanes: int = MAX_LANES):
    return _compiled(conv_forward_program, x_dtype, kernel_size, lanes, FORWARD_TOKENS)


def compile_conv_backward(x_dtype: str = "bfloat16", kernel_size: int = 4, lanes: int = MAX_LANES,
                          block_tokens: int = BACKWARD_TOKENS):
    return _compiled(conv_backward_program, x_dtype, kernel_size, lanes, block_tokens)


@functools.lru_cache(maxsize=None)
def _compiled(program, x_dtype: str, kernel_size: int, lanes: int, block_tokens: int):
    """One compile per specialisation however its caller spells the arguments."""
    return compile_for_hopper(program(x_dtype, kernel_size, lanes, block_tokens=block_tokens))


def lanes_for(*tensors: torch.Tensor) -> int:
    """The widest lanes (a power of two up to MAX_LANES, at most 16 bytes) that splits the channels of
    every tensor [N, C] into whole vectors starting on a vector boundary; 1 for an odd width."""
    lanes = MAX_LANES
    while lanes > 1 and any(t.shape[-1] % lanes or t.data_ptr() % (lanes * t.element_size())
                            or lanes * t.element_size() > 16 for t in tensors):
        lanes //= 2
    return lanes


def conv_forward(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """x [N, C] contiguous, weight [C, K] float32 contiguous, position [N] int32 -> y [N, C]."""
    y = torch.empty_like(x)
    if x.numel():
        lanes = lanes_for(x, y)
        groups = x.shape[1] // lanes
        compile_conv_forward(dtype_name(x), weight.shape[1], lanes)(
            x.view(-1, groups, lanes), weight.view(groups, lanes, -1), position, y.view(-1, groups, lanes))
    return y


def conv_backward(x, weight, position, dy, block_tokens: int = BACKWARD_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [N, C] (x's dtype) and dw [C, K] float32 for the forward above. block_tokens: the tokens a
    thread walks (`bench --compare conv` times shorter blocks, which give short sequences more CTAs)."""
    dx = torch.empty_like(x)
    num_blocks = -(-x.shape[0] // block_tokens)
    dw_partial = torch.empty(num_blocks, *weight.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        lanes = lanes_for(x, dy, dx)
        groups = x.shape[1] // lanes
        compile_conv_backward(dtype_name(x), weight.shape[1], lanes, block_tokens)(
            x.view(-1, groups, lanes), weight.view(groups, lanes, -1), position, dy.view(-1, groups, lanes),
            dx.view(-1, groups, lanes), dw_partial.view(num_blocks, groups, lanes, -1))
    return dx, dw_partial.sum(0)


class CausalConvSilu(torch.autograd.Function):
    """Keeps x (and the positions) only: the backward recomputes the conv in registers."""

    @staticmethod
    def forward(ctx, x, weight, position):
        taps = weight.reshape(weight.shape[0], -1).to(torch.float32).contiguous()
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(flat, taps, position)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return conv_forward(flat, taps, position).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        flat, taps, position = ctx.saved_tensors
        dx, dw = conv_backward(flat, taps, position, dy.reshape(flat.shape).contiguous())
        return dx.view(dy.shape), dw.view(ctx.weight_shape).to(ctx.weight_dtype), None


def causal_conv1d_silu_hopper(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv) of x [B, T, C] (bfloat16, float16 or float32) with weight
    [C, 1, K] or [C, K]; position [B * T] int32: each token's position in its document (or row)."""
    return CausalConvSilu.apply(x, weight, position)
