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


@functools.lru_cache(maxsize=None)
def compile_conv_forward(x_dtype: str = "bfloat16", kernel_size: int = 4):
    return compile_for_hopper(conv_forward_program(x_dtype, kernel_size))


@functools.lru_cache(maxsize=None)
def compile_conv_backward(x_dtype: str = "bfloat16", kernel_size: int = 4):
    return compile_for_hopper(conv_backward_program(x_dtype, kernel_size))


def conv_forward(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """x [N, C] contiguous, weight [C, K] float32 contiguous, position [N] int32 -> y [N, C]."""
    y = torch.empty_like(x)
    if x.numel():
        compile_conv_forward(dtype_name(x), weight.shape[1])(x, weight, position, y)
    return y


def conv_backward(x, weight, position, dy) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [N, C] (x's dtype) and dw [C, K] float32 for the forward above."""
    dx = torch.empty_like(x)
    num_blocks = -(-x.shape[0] // BACKWARD_TOKENS)
    dw_partial = torch.empty(num_blocks, *weight.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        compile_conv_backward(dtype_name(x), weight.shape[1])(x, weight, position, dy, dx, dw_partial)
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
