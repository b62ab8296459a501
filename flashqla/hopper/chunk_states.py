"""State-only recurrence in the X/Y form (docs/gdn-math.md §2.4):

    X = -diag(beta) A~^T K   (S-independent);   Y = e^{gamma_C} K S0 - E V;   S1 = e^{gamma_C} S0 + X^T Y

Two matrix products per chunk sit on the sequential path (K S0 and X^T Y). Used for the states
entering every chunk (the backward's recomputation) and for context parallelism: a piece's
zero-start end state, and its K x K transition M (S_end = M S_start + S_end|0), computed as extra
column blocks that start from the identity with V = 0.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import chunk_offsets
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, LOG2E, compile_for_hopper, dtype_name

_C = CHUNK_SIZE


def chunk_states_program(value_block: int, dtype: str = "bfloat16",
                         beta_dtype: str = "float32", head_dim: int = HEAD_DIM, use_initial_state: bool = True,
                         store_chunk_states: bool = True, states_dtype: str = "bfloat16",
                         with_transition: bool = False, threads: int = 128, num_stages: int = 2):
    """Grid: (V / BV value blocks [+ K / BV transition blocks], heads, sequences)."""
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_transitions = T.dynamic("num_transitions")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    K = head_dim
    V = head_dim
    BV = value_block
    value_blocks = V // BV
    grid_blocks = value_blocks + (K // BV if with_transition else 0)

    @T.prim_func
    def chunk_states_kernel(
        k: T.Tensor((num_tokens, num_qk_heads, K), dtype),
        v: T.Tensor((num_tokens, num_v_heads, V), dtype),
        gamma: T.Tensor((num_tokens, num_v_heads), "float32"),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), "bfloat16"),
        initial_state: T.Tensor((num_sequences, num_v_heads, K, V), "float32"),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        final_state: T.Tensor((num_sequences, num_v_heads, K, V), "float32"),
        transition: T.Tensor((num_transitions, num_v_heads, K, K), "float32"),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), states_dtype),
    ):
        with T.Kernel(grid_blocks, num_v_heads, num_sequences, threads=threads) as (block, head, sequence):
            qk_head = head // (num_v_heads // num_qk_heads)
            is_transition = block >= value_blocks
            col0 = T.if_then_else(is_transition, (block - value_blocks) * BV, block * BV)
            v0 = T.if_then_else(is_transition, 0, block * BV)
            start = cu_seqlens[sequence]
            end = cu_seqlens[sequence + 1]
            n_chunks = T.ceildiv(end - start, _C)
            first_chunk = chunk_offsets[sequence]

            k_shared = T.alloc_shared((_C, K), dtype)
            v_shared = T.alloc_shared((_C, BV), dtype)
            inverse_shared = T.alloc_shared((_C, _C), "bfloat16")
            gamma_shared = T.alloc_shared((_C,), "float32")
            beta_shared = T.alloc_shared((_C,), "float32")
            # Consumer-side copies: TileLang's producer may refill gamma/beta_shared as soon as the
            # first product of the chunk is issued.
            beta_private = T.alloc_shared((_C,), "float32")
            end_decay = T.alloc_shared((_C,), "float32")
            # X sums over the rows of A~ (A~^T K): rows past the sequence end must be zero here.
            inverse_masked = T.alloc_shared((_C, _C), "bfloat16")
            state_shared = T.alloc_shared((K, BV), dtype)
            x_shared = T.alloc_shared((_C, K), dtype)
            y_shared = T.alloc_shared((_C, BV), dtype)

            state = T.alloc_fragment((K, BV), "float32")
            x = T.alloc_fragment((_C, K), "float32")
            ks = T.alloc_fragment((_C, BV), "float32")
            chunk_decay = T.alloc_var("float32")

            if is_transition:
                for i, j in T.Parallel(K, BV):
                    state[i, j] = T.if_then_else(i == col0 + j, 1.0, 0.0)
            elif use_initial_state:
                T.copy(initial_state[sequence, head, 0:K, v0:v0 + BV], state)
            else:
                T.clear(state)

            for c in T.Pipelined(n_chunks, num_stages=num_stages):
                left = start + c * _C
                T.copy(k[left:left + _C, qk_head, 0:K], k_shared)
                T.copy(v[left:left + _C, head, v0:v0 + BV], v_shared)
                T.copy(inverse[left:left + _C, head, 0:_C], inverse_shared)
                last = T.min(end - left, _C) - 1
                for t in T.Parallel(_C):
                    gamma_shared[t] = gamma[left + T.min(t, last), head] * LOG2E
                    beta_shared[t] = T.if_then_else(t <= last, T.cast(beta[left + t, head], "float32"), 0.0)

                for t in T.Parallel(_C):
                    beta_private[t] = beta_shared[t]
                    end_decay[t] = T.exp2(gamma_shared[_C - 1] - gamma_shared[t])
                chunk_decay = T.exp2(gamma_shared[_C - 1])
                for t, s in T.Parallel(_C, _C):
                    inverse_masked[t, s] = T.if_then_else(t <= last, inverse_shared[t, s], T.cast(0, "bfloat16"))
                T.copy(state, state_shared)
                if store_chunk_states:
                    if not is_transition:
                        T.copy(state, chunk_states[first_chunk + c, head, 0:K, v0:v0 + BV])
                T.gemm(inverse_masked, k_shared, x, transpose_A=True, clear_accum=True)
                T.gemm(k_shared, state_shared, ks, clear_accum=True)
                for t, i in T.Parallel(_C, K):
                    x_shared[t, i] = -beta_private[t] * x[t, i]
                for t, j in T.Parallel(_C, BV):
                    y_shared[t, j] = chunk_decay * ks[t, j] - T.if_then_else(
                        is_transition, 0.0, end_decay[t] * v_shared[t, j])
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] * chunk_decay
                T.gemm(x_shared, y_shared, state, transpose_A=True)

            if is_transition:
                T.copy(state, transition[sequence, head, 0:K, col0:col0 + BV])
            else:
                T.copy(state, final_state[sequence, head, 0:K, v0:v0 + BV])

    return chunk_states_kernel


@functools.lru_cache(maxsize=None)
def compile_chunk_states(value_block: int, dtype: str = "bfloat16",
                         beta_dtype: str = "float32", head_dim: int = HEAD_DIM, use_initial_state: bool = True,
                         store_chunk_states: bool = True, states_dtype: str = "bfloat16",
                         with_transition: bool = False):
    # A 128-wide state block needs two warpgroups to stay in registers.
    threads = 128 if value_block <= 64 else 256
    program = chunk_states_program(value_block, dtype, beta_dtype, head_dim,
                                   use_initial_state, store_chunk_states, states_dtype, with_transition,
                                   threads=threads)
    return compile_for_hopper(program, fast_math=True)


def chunk_states(k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                 inverse: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor,
                 value_block: int = 64, states_dtype: torch.dtype = torch.bfloat16,
                 store_chunk_states: bool = True, with_transition: bool = False,
                 offsets: torch.Tensor | None = None, num_chunks: int | None = None):
    """States entering every chunk and the final state of each sequence, on flattened inputs.

    k: [T, Hqk, K]; v: [T, Hv, V]; gamma (chunk-local cumsum, fp32), beta: [T, Hv];
    inverse: [T, Hv, 64] bf16; initial_state: [N, Hv, K, V] fp32 or None; cu_seqlens: int32 [N+1].
    Returns (chunk_states [num_chunks, Hv, K, V] or None, final_state [N, Hv, K, V] fp32,
    transition [N, Hv, K, K] fp32 or None); chunk c of sequence n is row chunk_offsets[n] + c.
    offsets, num_chunks: chunk_offsets(cu_seqlens) and its last entry, when the caller holds them
    (a plan's); saves a device->host read.
    """
    num_tokens, num_qk_heads, head_dim = k.shape
    num_v_heads = v.shape[1]
    num_sequences = cu_seqlens.numel() - 1
    if (offsets is None) != (num_chunks is None):
        raise ValueError("chunk_states: pass offsets and num_chunks together, or neither")
    if offsets is None:
        offsets = chunk_offsets(cu_seqlens)
        num_chunks = int(offsets[-1].item())
    device = k.device
    use_initial_state = initial_state is not None
    if initial_state is None:
        initial_state = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, dtype=torch.float32, device=device)
    final_state = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, dtype=torch.float32, device=device)
    transition = torch.empty((num_sequences if with_transition else 1), num_v_heads, head_dim, head_dim,
                             dtype=torch.float32, device=device)
    states = torch.empty((max(num_chunks, 1) if store_chunk_states else 1), num_v_heads, head_dim, head_dim,
                         dtype=states_dtype, device=device)
    kernel = compile_chunk_states(value_block, dtype_name(k), dtype_name(beta),
                                  head_dim, use_initial_state, store_chunk_states, dtype_name(states),
                                  with_transition)
    kernel(k, v, gamma, beta, inverse, initial_state.contiguous(), cu_seqlens, offsets, final_state, transition,
           states)
    return (states if store_chunk_states else None), final_state, (transition if with_transition else None)
