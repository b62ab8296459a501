"""Fused chunked forward of the gated delta rule: o and the final state (gdn-kernels.md section 2).

One CTA per (sequence, value head, V block) walks its sequence's 64-token chunks in order with
the fp32 state S (K x BV) held in registers. Per chunk, with gamma the chunk-local cumsum of g:

    U = K S0;  W = V - D U;  Delta = (Gm * A~ * beta_col) W
    O = scale (D Q S0 + (Gm * tril(Q K^T)) Delta);  S1 = e^{gamma_C} S0 + K^T (E Delta)

Loads of whole 64-row tiles may run past the sequence end (into the next sequence, or zero-filled
past the tensor): those rows are neutralised by beta = 0 and E = 0 and gamma clamped to the
sequence's last value, so they never reach valid rows or the state; their o rows are not stored.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import CHUNK_SIZE, chunk_offsets
from flashqla.hopper.cumsum import HOPPER_TARGET

_C = CHUNK_SIZE
_LOG2E = 1.4426950408889634
_PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def fused_forward_program(num_v_heads: int, num_qk_heads: int, value_block: int, scale: float,
                          dtype: str = "bfloat16", beta_dtype: str = "float32", head_dim: int = 128,
                          use_initial_state: bool = True, store_final_state: bool = True,
                          store_chunk_states: bool = False, threads: int = 256, num_stages: int = 2):
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    group = num_v_heads // num_qk_heads
    K = head_dim
    V = head_dim
    BV = value_block
    value_blocks = V // BV

    @T.prim_func
    def fused_forward_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, K), dtype),
        v: T.Tensor((num_tokens, num_v_heads, V), dtype),
        gamma: T.Tensor((num_tokens, num_v_heads), "float32"),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), "bfloat16"),
        initial_state: T.Tensor((num_sequences, num_v_heads, K, V), "float32"),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        o: T.Tensor((num_tokens, num_v_heads, V), dtype),
        final_state: T.Tensor((num_sequences, num_v_heads, K, V), "float32"),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), dtype),
    ):
        with T.Kernel(value_blocks, num_v_heads, num_sequences, threads=threads) as (vb, head, sequence):
            qk_head = head // group
            v0 = vb * BV
            start = cu_seqlens[sequence]
            end = cu_seqlens[sequence + 1]
            n_chunks = T.ceildiv(end - start, _C)
            first_chunk = chunk_offsets[sequence]

            q_shared = T.alloc_shared((_C, K), dtype)
            k_shared = T.alloc_shared((_C, K), dtype)
            v_shared = T.alloc_shared((_C, BV), dtype)
            inverse_shared = T.alloc_shared((_C, _C), "bfloat16")
            gamma_shared = T.alloc_shared((_C,), "float32")
            beta_shared = T.alloc_shared((_C,), "float32")
            state_shared = T.alloc_shared((K, BV), dtype)
            w_shared = T.alloc_shared((_C, BV), dtype)
            delta_shared = T.alloc_shared((_C, BV), dtype)
            decayed_delta_shared = T.alloc_shared((_C, BV), dtype)
            ab_shared = T.alloc_shared((_C, _C), dtype)
            p_shared = T.alloc_shared((_C, _C), dtype)
            o_shared = T.alloc_shared((_C, BV), dtype)

            state = T.alloc_fragment((K, BV), "float32")
            u = T.alloc_fragment((_C, BV), "float32")
            out = T.alloc_fragment((_C, BV), "float32")
            delta = T.alloc_fragment((_C, BV), "float32")
            qk = T.alloc_fragment((_C, _C), "float32")
            gamma_last = T.alloc_var("float32")

            if use_initial_state:
                T.copy(initial_state[sequence, head, 0:K, v0:v0 + BV], state)
            else:
                T.clear(state)

            for c in T.Pipelined(n_chunks, num_stages=num_stages):
                left = start + c * _C
                T.copy(q[left:left + _C, qk_head, 0:K], q_shared)
                T.copy(k[left:left + _C, qk_head, 0:K], k_shared)
                T.copy(v[left:left + _C, head, v0:v0 + BV], v_shared)
                T.copy(inverse[left:left + _C, head, 0:_C], inverse_shared)
                last = T.min(end - left, _C) - 1
                for t in T.Parallel(_C):
                    gamma_shared[t] = gamma[left + T.min(t, last), head] * _LOG2E
                    beta_shared[t] = T.if_then_else(t <= last, T.cast(beta[left + t, head], "float32"), 0.0)

                T.copy(state, state_shared)
                if store_chunk_states:
                    T.copy(state_shared, chunk_states[first_chunk + c, head, 0:K, v0:v0 + BV])
                T.gemm(k_shared, state_shared, u, clear_accum=True)
                T.gemm(q_shared, state_shared, out, clear_accum=True)
                T.gemm(q_shared, k_shared, qk, transpose_B=True, clear_accum=True)
                gamma_last = gamma_shared[_C - 1]

                for t, j in T.Parallel(_C, BV):
                    w_shared[t, j] = v_shared[t, j] - T.exp2(gamma_shared[t]) * u[t, j]
                for t, s in T.Parallel(_C, _C):
                    ab_shared[t, s] = T.if_then_else(
                        s <= t,
                        T.exp2(gamma_shared[t] - gamma_shared[s]) * beta_shared[s] * inverse_shared[t, s],
                        0.0)
                    p_shared[t, s] = T.if_then_else(
                        s <= t, T.exp2(gamma_shared[t] - gamma_shared[s]) * scale * qk[t, s], 0.0)
                T.gemm(ab_shared, w_shared, delta, clear_accum=True)
                for t, j in T.Parallel(_C, BV):
                    delta_shared[t, j] = delta[t, j]
                    decayed_delta_shared[t, j] = T.if_then_else(
                        t <= last, T.exp2(gamma_last - gamma_shared[t]) * delta[t, j], 0.0)
                for t, j in T.Parallel(_C, BV):
                    out[t, j] = out[t, j] * (T.exp2(gamma_shared[t]) * scale)
                T.gemm(p_shared, delta_shared, out)
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] * T.exp2(gamma_last)
                T.gemm(k_shared, decayed_delta_shared, state, transpose_A=True)

                T.copy(out, o_shared)
                if left + _C <= end:
                    T.copy(o_shared, o[left:left + _C, head, v0:v0 + BV])
                else:
                    for t, j in T.Parallel(_C, BV):
                        if t <= last:
                            o[left + t, head, v0 + j] = o_shared[t, j]

            if store_final_state:
                T.copy(state, final_state[sequence, head, 0:K, v0:v0 + BV])

    return fused_forward_kernel


@functools.lru_cache(maxsize=None)
def compile_fused_forward(num_v_heads: int, num_qk_heads: int, value_block: int, scale: float,
                          dtype: str = "bfloat16", beta_dtype: str = "float32", head_dim: int = 128,
                          use_initial_state: bool = True, store_final_state: bool = True,
                          store_chunk_states: bool = False):
    program = fused_forward_program(num_v_heads, num_qk_heads, value_block, scale, dtype, beta_dtype, head_dim,
                                    use_initial_state, store_final_state, store_chunk_states)
    return tilelang.compile(program, target=HOPPER_TARGET, pass_configs=_PASS_CONFIGS)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                  inverse: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, value_block: int, output_final_state: bool = True,
                  store_chunk_states: bool = False, offsets: torch.Tensor | None = None):
    """o, final state and (optionally) the bf16 states entering every chunk, on flattened inputs.

    q, k: [T, Hqk, K]; v: [T, Hv, V]; gamma (fp32 chunk-local cumsum), beta: [T, Hv];
    inverse: [T, Hv, 64] bf16; initial_state: [N, Hv, K, V] fp32 or None; cu_seqlens: int32 [N+1].
    """
    num_tokens, num_qk_heads, head_dim = k.shape
    num_v_heads = v.shape[1]
    num_sequences = cu_seqlens.numel() - 1
    device = k.device
    if offsets is None:
        offsets = chunk_offsets(cu_seqlens)
    use_initial_state = initial_state is not None
    if initial_state is None:
        initial_state = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, dtype=torch.float32, device=device)
    final_state = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, dtype=torch.float32, device=device)
    total_chunks = int(offsets[-1].item()) if store_chunk_states else 1
    states = torch.empty(max(total_chunks, 1), num_v_heads, head_dim, head_dim, dtype=v.dtype, device=device)
    o = torch.empty_like(v)
    kernel = compile_fused_forward(num_v_heads, num_qk_heads, value_block, float(scale), _dtype_name(v),
                                   _dtype_name(beta), head_dim, use_initial_state, output_final_state,
                                   store_chunk_states)
    kernel(q, k, v, gamma, beta, inverse, initial_state.contiguous(), cu_seqlens, offsets, o, final_state, states)
    return o, (final_state if output_final_state else None), (states if store_chunk_states else None)
