"""Fused chunked forward of the gated delta rule: o and the final state (docs/gdn-math.md §2.3).

One CTA per (piece, value head, V block) walks 64-token chunks in order with the fp32 state S
(K x BV) in registers. Per chunk, with gamma the chunk-local cumsum of g:

    U = K S0;  W = V - D U;  Delta = Ab W;  O = scale D Q S0 + P Delta;  S1 = e^{gamma_C} S0 + K^T (E Delta)

with Ab = Gm * A~ * beta_col and P = scale Gm * tril(Q K^T) built beforehand for every chunk in
parallel (gated_products.py), so only the S-dependent products sit on the sequential walk.

A piece is a run of whole chunks of one sequence (the whole sequence unless it is split for
intra-card context parallelism). Its CTA starts walking at `walk_start` (a chunk boundary at or
before the piece start, from zero state, or from h0 at the sequence start) and writes o only for
the piece's own chunks: the warm-up chunks rebuild the entering state (see chunk_plan.py).

Whole 64-row tiles are loaded even past a sequence end (rows of the next sequence, or zeros past
the tensor). Valid rows of Ab and P are zero in those columns, those rows get E = 0 and gamma
clamped to the sequence's last value, so they never reach valid rows or the state, and their o rows
are not stored.

Head counts, lengths and the scale are run-time values: one compiled kernel per (V block, dtype).
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import PIECE_FIELDS, chunk_offsets
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, LOG2E, compile_for_hopper, dtype_name

_C = CHUNK_SIZE
# TileLang's automatic warp specialisation gives the TMA producer as many threads as the consumers,
# capping every thread at 128 registers: a 128-wide V block spills there, 64 does not (much).
MAX_VALUE_BLOCK = 64


def fused_forward_program(value_block: int, dtype: str = "bfloat16", head_dim: int = HEAD_DIM,
                          store_chunk_states: bool = False, threads: int = 256, num_stages: int = 2):
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_pieces = T.dynamic("num_pieces")
    num_chunks = T.dynamic("num_chunks")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
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
        gated_inverse: T.Tensor((num_tokens, num_v_heads, _C), dtype),
        scores: T.Tensor((num_tokens, num_v_heads, _C), dtype),
        initial_state: T.Tensor((num_sequences, num_v_heads, K, V), "float32"),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        pieces: T.Tensor((num_pieces, PIECE_FIELDS), "int32"),
        walk_start: T.Tensor((num_pieces, num_v_heads), "int32"),
        o: T.Tensor((num_tokens, num_v_heads, V), dtype),
        final_state: T.Tensor((num_sequences, num_v_heads, K, V), "float32"),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), dtype),
        scale: T.float32,
        use_initial_state: T.int32,
    ):
        with T.Kernel(value_blocks, num_v_heads, num_pieces, threads=threads) as (vb, head, piece):
            qk_head = head // (num_v_heads // num_qk_heads)
            v0 = vb * BV
            sequence = pieces[piece, 0]
            piece_start = pieces[piece, 1]
            end = pieces[piece, 2]
            ends_sequence = pieces[piece, 3]
            walk = walk_start[piece, head]
            n_chunks = T.ceildiv(end - walk, _C)
            first_chunk = chunk_offsets[sequence]

            q_shared = T.alloc_shared((_C, K), dtype)
            k_shared = T.alloc_shared((_C, K), dtype)
            v_shared = T.alloc_shared((_C, BV), dtype)
            ab_shared = T.alloc_shared((_C, _C), dtype)
            p_shared = T.alloc_shared((_C, _C), dtype)
            gamma_shared = T.alloc_shared((_C,), "float32")
            # Consumer-side copies: TileLang's producer may refill gamma_shared as soon as the first
            # products of the chunk are issued, so the decays are taken out of it first.
            row_decay = T.alloc_shared((_C,), "float32")
            end_decay = T.alloc_shared((_C,), "float32")
            state_shared = T.alloc_shared((K, BV), dtype)
            w_shared = T.alloc_shared((_C, BV), dtype)
            delta_shared = T.alloc_shared((_C, BV), dtype)
            decayed_delta_shared = T.alloc_shared((_C, BV), dtype)
            o_shared = T.alloc_shared((_C, BV), dtype)

            state = T.alloc_fragment((K, BV), "float32")
            u = T.alloc_fragment((_C, BV), "float32")
            out = T.alloc_fragment((_C, BV), "float32")
            delta = T.alloc_fragment((_C, BV), "float32")
            chunk_decay = T.alloc_var("float32")

            if use_initial_state != 0 and walk == cu_seqlens[sequence]:
                T.copy(initial_state[sequence, head, 0:K, v0:v0 + BV], state)
            else:
                T.clear(state)

            for c in T.Pipelined(n_chunks, num_stages=num_stages):
                left = walk + c * _C
                T.copy(q[left:left + _C, qk_head, 0:K], q_shared)
                T.copy(k[left:left + _C, qk_head, 0:K], k_shared)
                T.copy(v[left:left + _C, head, v0:v0 + BV], v_shared)
                T.copy(gated_inverse[left:left + _C, head, 0:_C], ab_shared)
                T.copy(scores[left:left + _C, head, 0:_C], p_shared)
                last = T.min(end - left, _C) - 1
                for t in T.Parallel(_C):
                    gamma_shared[t] = gamma[left + T.min(t, last), head] * LOG2E

                for t in T.Parallel(_C):
                    row_decay[t] = T.exp2(gamma_shared[t])
                    end_decay[t] = T.if_then_else(t <= last, T.exp2(gamma_shared[_C - 1] - gamma_shared[t]), 0.0)
                T.copy(state, state_shared)
                if store_chunk_states:
                    # The piece's own chunks only: a warm-up chunk belongs to the piece before,
                    # whose CTA stores it.
                    if left >= piece_start:
                        T.copy(state_shared, chunk_states[first_chunk + (left - cu_seqlens[sequence]) // _C, head,
                                                          0:K, v0:v0 + BV])
                T.gemm(k_shared, state_shared, u, clear_accum=True)
                T.gemm(q_shared, state_shared, out, clear_accum=True)
                chunk_decay = row_decay[_C - 1]

                for t, j in T.Parallel(_C, BV):
                    w_shared[t, j] = v_shared[t, j] - row_decay[t] * u[t, j]
                T.gemm(ab_shared, w_shared, delta, clear_accum=True)
                for t, j in T.Parallel(_C, BV):
                    delta_shared[t, j] = delta[t, j]
                    decayed_delta_shared[t, j] = end_decay[t] * delta[t, j]
                for t, j in T.Parallel(_C, BV):
                    out[t, j] = out[t, j] * (row_decay[t] * scale)
                T.gemm(p_shared, delta_shared, out)
                for i, j in T.Parallel(K, BV):
                    state[i, j] = state[i, j] * chunk_decay
                T.gemm(k_shared, decayed_delta_shared, state, transpose_A=True)

                if left >= piece_start:
                    T.copy(out, o_shared)
                    if left + _C <= end:
                        T.copy(o_shared, o[left:left + _C, head, v0:v0 + BV])
                    else:
                        for t, j in T.Parallel(_C, BV):
                            if t <= last:
                                o[left + t, head, v0 + j] = o_shared[t, j]

            if ends_sequence != 0:
                T.copy(state, final_state[sequence, head, 0:K, v0:v0 + BV])

    return fused_forward_kernel


@functools.lru_cache(maxsize=None)
def compile_fused_forward(value_block: int, dtype: str = "bfloat16", head_dim: int = HEAD_DIM,
                          store_chunk_states: bool = False):
    program = fused_forward_program(value_block, dtype, head_dim, store_chunk_states)
    return compile_for_hopper(program, fast_math=True)


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor,
                  gated_inverse: torch.Tensor, scores: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, value_block: int, pieces: torch.Tensor, walk_start: torch.Tensor,
                  store_chunk_states: bool = False, offsets: torch.Tensor | None = None,
                  num_chunks: int | None = None):
    """(o, final_state, chunk_states or None) on flattened inputs.

    q, k: [T, Hqk, K]; v: [T, Hv, V]; gamma (fp32 chunk-local cumsum): [T, Hv];
    gated_inverse, scores: [T, Hv, 64] from gated_products.gated_products; initial_state: [N, Hv, K, V] fp32 or None; cu_seqlens: int32 [N+1];
    pieces, walk_start: from chunk_plan.plan_pieces / walk_starts. store_chunk_states: also return the
    state entering every chunk, [num_chunks, Hv, K, V] in v's dtype (chunk c of sequence n at row
    offsets[n] + c); in a split sequence each piece's states come from its own (warm-up) walk.
    num_chunks: offsets' last entry when the caller knows it.
    """
    num_tokens, num_qk_heads, head_dim = k.shape
    num_v_heads = v.shape[1]
    num_sequences = cu_seqlens.numel() - 1
    device = k.device
    if offsets is None:
        offsets = chunk_offsets(cu_seqlens)
    use_initial_state = initial_state is not None
    if initial_state is None:
        initial_state = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, dtype=torch.float32,
                                    device=device)
    final_state = torch.empty(num_sequences, num_v_heads, head_dim, head_dim, dtype=torch.float32, device=device)
    if not store_chunk_states:
        total_chunks = 1
    else:  # num_chunks (the plan's) spares a device->host read
        total_chunks = int(offsets[-1].item()) if num_chunks is None else num_chunks
    states = torch.empty(max(total_chunks, 1), num_v_heads, head_dim, head_dim, dtype=v.dtype, device=device)
    o = torch.empty_like(v)
    kernel = compile_fused_forward(value_block, dtype_name(v), head_dim, store_chunk_states)
    kernel(q, k, v, gamma, gated_inverse, scores, initial_state, cu_seqlens, offsets, pieces, walk_start, o, final_state,
           states, float(scale), int(use_initial_state))
    return o, final_state, (states if store_chunk_states else None)
