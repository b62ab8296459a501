"""State gradients of the chunked gated delta rule: the sequential part of the backward.

The state gradient obeys its own reverse recurrence, independent of the forward states
(docs/gdn-math.md §3.1):

    dDelta = E K dS1 + Pm^T dO,   dU = -D Ab^T dDelta,   dS0 = e^{gamma_C} dS1 + Q^T (scale D dO) + K^T dU

Ab and Pm come precomputed for every chunk (kept by the forward walk, fused_forward.py), so the walk holds only the
dS-dependent products. One CTA per (V block, value head, sequence) walks the chunks in reverse
with dS (K x BV, float32) in registers, split by columns between two consumer warpgroups (every
product runs as two m64 x BV/2 halves side by side, which shortens the chain of five products a
chunk), loads pipelined two chunks ahead, stores the gradient
leaving every chunk (dS1, bf16) for the chunk-parallel kernel (backward_chunk_grads.py), and
writes dh0. Columns of dS are independent, so V blocks add parallelism at no extra cost on the
critical path.

normalize_qk: q and k are the inputs of use_qk_l2norm_in_kernel's norm, with its r per row; r joins the
row factors already beside q and k (scale D on dO's rows for Q^T, E on K dS1's rows, D on dU's rows for
K^T), so the walk is that of q^ and k^ without reading them.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import PIECE_FIELDS
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, WARPGROUP, compile_for_hopper, times_rstd

_C = CHUNK_SIZE
# Two consumer warpgroups and three load stages: 1.07-1.09x one warpgroup with two stages on the
# H200 (sixteenth session, docs/kernel-notes.md); three stages alone were 0.98-0.99x.
_WARPGROUPS = 2
_STAGES = 3  # T.Pipelined's load stages (up to ~216 KB of shared memory at a V block of 64)


def state_grads_program(value_block: int = 32, pieces: bool = False, normalize_qk: bool = False):
    """pieces=False: one CTA per (V block, head, sequence).
    pieces=True (what backward.py runs where the forward's plan cut a sequence): one CTA per (V block,
    head, piece of a sequence); the CTA starts at walk_end[piece, head] (the sequence end, from dht,
    or a chunk boundary after the piece, from zero: a decay-truncated warm-up), stores dS only for
    the piece's own chunks, and writes dh0 only when the piece starts its sequence.
    normalize_qk: q_rstd, k_rstd hold the L2 norm's r of q's and k's rows, one column per value head (else
    they are not read): indexed by the CTA's own head, their loads join the pipeline's asynchronous copies,
    where an index of the qk head (head // group) kept them in the consumers, one exposed load a chunk."""
    K = V = HEAD_DIM
    BV = value_block
    num_value_blocks = V // BV
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_pieces = T.dynamic("num_pieces")
    rstd_rows = T.dynamic("rstd_rows")
    op = "bfloat16"
    f32 = "float32"

    @T.prim_func
    def state_grads_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), op),
        k: T.Tensor((num_tokens, num_qk_heads, K), op),
        gamma: T.Tensor((num_tokens, num_v_heads), f32),
        gated_inverse: T.Tensor((num_tokens, num_v_heads, _C), op),
        scores: T.Tensor((num_tokens, num_v_heads, _C), op),
        do: T.Tensor((num_tokens, num_v_heads, V), op),
        dht: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        chunk_state_grads: T.Tensor((num_chunks, num_v_heads, K, V), op),
        dh0: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        piece_table: T.Tensor((num_pieces, PIECE_FIELDS), "int32"),
        walk_end: T.Tensor((num_pieces, num_v_heads), "int32"),
        q_rstd: T.Tensor((rstd_rows, num_v_heads), f32),
        k_rstd: T.Tensor((rstd_rows, num_v_heads), f32),
        scale: T.float32,
    ):
        with T.Kernel(num_value_blocks, num_v_heads, num_pieces if pieces else num_sequences,
                      threads=WARPGROUP * _WARPGROUPS) as (vblock, head, row):
            qk_head = head // (num_v_heads // num_qk_heads)
            v0 = vblock * BV
            seq = piece_table[row, 0] if pieces else row
            bos = cu_seqlens[seq]
            eos = cu_seqlens[seq + 1]
            first_chunk = chunk_offsets[seq]
            # The walk covers [walk_first, walk_last): the whole sequence, or a piece and its warm-up.
            walk_first = piece_table[row, 1] if pieces else bos
            walk_last = walk_end[row, head] if pieces else eos
            seq_chunks = (walk_last - walk_first + _C - 1) // _C

            q_s = T.alloc_shared((_C, K), op)
            k_s = T.alloc_shared((_C, K), op)
            do_s = T.alloc_shared((_C, BV), op)
            ab_s = T.alloc_shared((_C, _C), op)
            pm_s = T.alloc_shared((_C, _C), op)
            pm_m_s = T.alloc_shared((_C, _C), op)
            ds_s = T.alloc_shared((K, BV), op)
            d_delta_s = T.alloc_shared((_C, BV), op)
            du_s = T.alloc_shared((_C, BV), op)
            dog_s = T.alloc_shared((_C, BV), op)
            gam_s = T.alloc_shared((_C,), f32)
            q_rstd_s = T.alloc_shared((_C,), f32) if normalize_qk else None
            k_rstd_s = T.alloc_shared((_C,), f32) if normalize_qk else None

            ds = T.alloc_fragment((K, BV), f32)
            d_delta = T.alloc_fragment((_C, BV), f32)
            dw = T.alloc_fragment((_C, BV), f32)

            if pieces:
                if walk_last == eos:
                    T.copy(dht[seq, head, 0:K, v0:v0 + BV], ds)
                else:  # truncated: the gradient from past the warm-up is below e^threshold
                    T.clear(ds)
            else:
                T.copy(dht[seq, head, 0:K, v0:v0 + BV], ds)
            for it in T.Pipelined(seq_chunks, num_stages=_STAGES):
                if pieces:
                    start = walk_first + (seq_chunks - 1 - it) * _C
                    chunk = (start - bos) // _C
                else:
                    chunk = seq_chunks - 1 - it
                    start = bos + chunk * _C
                last = T.min(eos - start, _C) - 1
                # Whole tiles; rows past the sequence end hold the next sequence's data. The pipelined
                # buffers stay as loaded: Pm is masked into its own buffer and dDelta's padded rows
                # are zeroed, which keeps those rows out of dS (Ab is zero above its diagonal).
                T.copy(q[start:start + _C, qk_head, 0:K], q_s)
                T.copy(k[start:start + _C, qk_head, 0:K], k_s)
                T.copy(do[start:start + _C, head, v0:v0 + BV], do_s)
                T.copy(gated_inverse[start:start + _C, head, 0:_C], ab_s)
                T.copy(scores[start:start + _C, head, 0:_C], pm_s)
                # Padded rows repeat the last gamma, so e^{gamma_C} is the decay over the real tokens.
                for t in T.Parallel(_C):
                    gam_s[t] = gamma[start + T.min(t, last), head]
                if normalize_qk:  # each row's own r, by value head: indexed as gamma is, so loaded as gamma is
                    for t in T.Parallel(_C):
                        q_rstd_s[t] = q_rstd[T.min(start + t, num_tokens - 1), head]
                        k_rstd_s[t] = k_rstd[T.min(start + t, num_tokens - 1), head]
                for t, s in T.Parallel(_C, _C):
                    pm_m_s[t, s] = T.if_then_else(t <= last, pm_s[t, s], T.cast(0, op))

                for i, j in T.Parallel(K, BV):
                    ds_s[i, j] = T.cast(ds[i, j], op)
                if pieces:
                    if start < piece_table[row, 2]:  # warm-up chunks belong to the next piece's CTA
                        T.copy(ds_s, chunk_state_grads[first_chunk + chunk, head, 0:K, v0:v0 + BV])
                else:
                    T.copy(ds_s, chunk_state_grads[first_chunk + chunk, head, 0:K, v0:v0 + BV])
                for t, d in T.Parallel(_C, BV):
                    dog_s[t, d] = T.if_then_else(
                        t <= last, T.cast(times_rstd(scale * T.exp(gam_s[t]), q_rstd_s, t) * T.cast(do_s[t, d], f32), op),
                        T.cast(0, op))

                T.gemm(k_s, ds_s, d_delta, clear_accum=True)
                for t, d in T.Parallel(_C, BV):
                    d_delta[t, d] = d_delta[t, d] * times_rstd(T.exp(gam_s[_C - 1] - gam_s[t]), k_rstd_s, t)
                T.gemm(pm_m_s, do_s, d_delta, transpose_A=True)
                for t, d in T.Parallel(_C, BV):
                    d_delta_s[t, d] = T.if_then_else(t <= last, T.cast(d_delta[t, d], op), T.cast(0, op))
                T.gemm(ab_s, d_delta_s, dw, transpose_A=True, clear_accum=True)
                for t, d in T.Parallel(_C, BV):
                    du_s[t, d] = T.cast(times_rstd(-T.exp(gam_s[t]), k_rstd_s, t) * dw[t, d], op)
                for i, j in T.Parallel(K, BV):
                    ds[i, j] = ds[i, j] * T.exp(gam_s[_C - 1])
                T.gemm(q_s, dog_s, ds, transpose_A=True)
                T.gemm(k_s, du_s, ds, transpose_A=True)

            if pieces:
                if walk_first == bos:
                    T.copy(ds, dh0[seq, head, 0:K, v0:v0 + BV])
            else:
                T.copy(ds, dh0[seq, head, 0:K, v0:v0 + BV])

    return state_grads_kernel


@functools.lru_cache(maxsize=None)
def compile_state_grads(value_block: int = 32, pieces: bool = False, normalize_qk: bool = False):
    return compile_for_hopper(state_grads_program(value_block, pieces, normalize_qk), fast_math=True)


def state_gradients(q, k, gamma, gated_inverse, scores, do, dht, scale, cu_seqlens, offsets, num_chunks,
                    value_block, pieces: torch.Tensor | None = None, walk_end: torch.Tensor | None = None,
                    rstds: tuple | None = None):
    """(dS leaving every chunk, bf16 [num_chunks, Hv, 128, 128]; dh0, float32 [N, Hv, 128, 128]).

    q, k: [T, Hqk, 128] bf16; gamma (chunk-local cumsum): [T, Hv] fp32; gated_inverse (Ab), scores
    (Pm, including scale): [T, Hv, 64] bf16 from the forward (forward.KeptForward); do: [T, Hv, 128] bf16;
    dht: [N, Hv, 128, 128] fp32; cu_seqlens, offsets: int32 [N + 1].
    pieces, walk_end: a forward plan's pieces (every sequence covered by one or more) and
    their walk_bounds(ahead=True); both None walks every sequence whole.
    rstds: (q_rstd, k_rstd), float32 [T, Hqk], when q and k are the inputs of use_qk_l2norm_in_kernel's
    norm and these its r: the gradients are then those of the walk of q^, k^. With grouped value heads
    they are repeated per value head for the kernel (8 bytes a token and head).
    """
    if (pieces is None) != (walk_end is None):
        raise ValueError("state_gradients: pass pieces and walk_end together, or neither")
    num_v_heads = do.shape[1]
    grads = torch.empty(max(num_chunks, 1), num_v_heads, HEAD_DIM, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    dh0 = torch.empty(cu_seqlens.numel() - 1, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=q.device)
    normalize_qk = rstds is not None
    if not normalize_qk:  # placeholders, never read
        rstds = (torch.empty(1, num_v_heads, dtype=torch.float32, device=q.device),) * 2
    elif num_v_heads != q.shape[1]:
        rstds = tuple(rstd.repeat_interleave(num_v_heads // q.shape[1], dim=1) for rstd in rstds)
    with_pieces = pieces is not None
    if not with_pieces:  # placeholders, unread by the whole-sequence kernel
        pieces = torch.zeros(1, PIECE_FIELDS, dtype=torch.int32, device=q.device)
        walk_end = torch.zeros(1, num_v_heads, dtype=torch.int32, device=q.device)
    compile_state_grads(value_block, with_pieces, normalize_qk)(
        q, k, gamma, gated_inverse, scores, do, dht, cu_seqlens, offsets, grads, dh0, pieces, walk_end,
        *rstds, float(scale))
    return grads, dh0

