"""Candidate (never run on a GPU yet): the state-gradient walk with its work split by role, so that a chunk's
chain holds three products instead of five.

The walk of backward_state_grads.py runs, per chunk and in sequence on its two consumer warpgroups,
K dS1, Pm^T dO, Ab^T dDelta, Q^T (scale D dO) and K^T dU, with the masks and scalings between them
(docs/gdn-math.md §3.1). Only three of those products depend on dS1, and the row and column factors
can sit in the operands instead of between products:

    dDelta = (E K) dS1 + Pm^T dO_m,   dU = M^T dDelta with M = Ab diag(-e^{gamma} r_k),
    dS0 = e^{gamma_C} dS1 + Q^T dOg + K^T dU,   dOg = diag(scale e^{gamma} r_q) dO_m

(dO_m: dO with the rows past the sequence end zeroed; E = diag(e^{gamma_C - gamma} r_k), zero past the
end). So, laid out like the forward walk (fused_forward.py; 512 threads, one CTA per SM):

- warpgroup 0 (state) holds dS in float32; a chunk: hands dS1 over as bf16, scales it by e^{gamma_C}, adds
  Q^T dOg, then K^T dU once it arrives;
- warpgroup 1 (delta): Pm^T dO_m before dS1 arrives, then (E K) dS1 into the same accumulator, dDelta to
  shared memory, dU = M^T dDelta, handed to the state;
- warpgroup 2 (prep) makes the chunk's E K, M (over Ab, in place), dOg and dO_m (over dO, in place) a chunk
  or two ahead, off the chain;
- warpgroup 3: one warp loads q, k, gamma and r, one dO, Ab and Pm (TMA, double-buffered), one stores dS1.

Buffers written once a chunk by one role and read by another are single where the chain itself orders
them (dS1 is written again only after the K^T dU that needed this chunk's dU, which needed the delta role's
(E K) dS1), double-buffered by chunk parity otherwise. Pieces and warm-ups as in backward_state_grads.py.
Same outputs (dS1 per chunk, bf16; dh0), not bitwise: E K, M and dOg are rounded to bf16 as operands where
the walk rounds the products' results.
"""

import functools
from types import SimpleNamespace

import tilelang.language as T
import torch

from flashqla.hopper.backward_state_grads import walk_operands
from flashqla.hopper.chunk_plan import PIECE_FIELDS
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, LOG2E, WARPGROUP, compile_for_hopper, times_rstd

_C = CHUNK_SIZE
_THREADS = 4 * WARPGROUP
# registers a thread after setmaxnreg: three math warpgroups and the loaders fill the SM's 64K
_MATH_REGISTERS = 152
_PRODUCER_REGISTERS = 56
MAX_VALUE_BLOCK = 64  # shared memory: ~194 KB at 64; a V block of 128 would need ~256


def state_grads_roles_program(value_block: int = 64, normalize_qk: bool = False):
    """One CTA per (V block, value head, piece); the piece table and walk_end as state_grads_program(pieces=True)
    takes them (whole sequences are pieces that end them). normalize_qk: q_rstd, k_rstd hold r by value head."""
    if value_block > MAX_VALUE_BLOCK:
        raise ValueError(f"state_grads_roles_program: value_block must be <= {MAX_VALUE_BLOCK}, got {value_block}")
    K = V = HEAD_DIM
    BV = value_block
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_pieces = T.dynamic("num_pieces")
    rstd_rows = T.dynamic("rstd_rows")
    op = "bfloat16"
    f32 = "float32"
    loader_threads = 2 * 32  # the two loading warps arrive on tiles_full
    reader_threads = 3 * WARPGROUP  # every math thread arrives on tiles_free

    @T.macro
    def state_role(sh, cta, dht, dh0):
        T.set_max_nreg(_MATH_REGISTERS, 1)
        ds = T.alloc_fragment((K, BV), f32)
        if cta.walk_last == cta.eos:
            T.copy(dht[cta.sequence, cta.head, 0:K, cta.v0:cta.v0 + BV], ds)
        else:  # truncated: the gradient from past the warm-up is below e^threshold
            T.clear(ds)
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            if c > 0:  # the store warp has read the chunk before's dS1
                T.barrier_wait(sh.ds_stored, (c - 1) % 2)
            T.copy(ds, sh.ds)
            T.fence_proxy_async()
            T.barrier_arrive(sh.ds_ready)
            T.barrier_wait(sh.prep_ready[stage], (c // 2) % 2)
            for i, j in T.Parallel(K, BV):
                ds[i, j] = ds[i, j] * sh.chunk_decay[stage]
            T.gemm(sh.q[stage, :, :], sh.dog[stage, :, :], ds, transpose_A=True)
            T.barrier_wait(sh.du_ready, c % 2)
            T.gemm(sh.k[stage, :, :], sh.du, ds, transpose_A=True)
            T.barrier_arrive(sh.tiles_free[stage])
        if cta.walk_first == cta.bos:
            T.copy(ds, dh0[cta.sequence, cta.head, 0:K, cta.v0:cta.v0 + BV])

    @T.macro
    def delta_role(sh, cta):
        T.set_max_nreg(_MATH_REGISTERS, 1)
        d_delta = T.alloc_fragment((_C, BV), f32)
        du = T.alloc_fragment((_C, BV), f32)
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            T.barrier_wait(sh.prep_ready[stage], (c // 2) % 2)
            T.gemm(sh.pm[stage, :, :], sh.do[stage, :, :], d_delta, transpose_A=True, clear_accum=True)
            T.barrier_wait(sh.ds_ready, c % 2)
            T.gemm(sh.ek[stage, :, :], sh.ds, d_delta)
            T.copy(d_delta, sh.d_delta)
            T.fence_proxy_async()
            T.gemm(sh.ab[stage, :, :], sh.d_delta, du, transpose_A=True, clear_accum=True)
            T.copy(du, sh.du)
            T.fence_proxy_async()
            T.barrier_arrive(sh.du_ready)
            T.barrier_arrive(sh.tiles_free[stage])

    @T.macro
    def prep_role(sh, cta, scale):
        """E K, M over Ab, dOg and dO_m over dO: every factor of a row or column in the operands."""
        T.set_max_nreg(_MATH_REGISTERS, 1)
        # Ab and dO are rewritten in place through registers, read whole before any write: an element loop that
        # reads and writes one shared buffer gets a barrier in every iteration from TileLang (fused_forward.py)
        ab = T.alloc_fragment((_C, _C), f32)
        do = T.alloc_fragment((_C, BV), f32)
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            last = T.min(cta.eos - cta.chunk_start(c), _C) - 1
            T.barrier_wait(sh.tiles_full[stage], (c // 2) % 2)
            T.copy(sh.ab[stage, :, :], ab)
            T.copy(sh.do[stage, :, :], do)
            # each row's factors once (an exponential a row, not one an element)
            for t in T.Parallel(_C):
                sh.ek_rows[t] = T.if_then_else(
                    t <= last, times_rstd(T.exp2(sh.gamma[stage, _C - 1] - sh.gamma[stage, t]), sh.k_rstd, stage, t), 0.0)
                sh.m_columns[t] = times_rstd(-T.exp2(sh.gamma[stage, t]), sh.k_rstd, stage, t)
                sh.dog_rows[t] = T.if_then_else(t <= last, times_rstd(scale * T.exp2(sh.gamma[stage, t]), sh.q_rstd, stage, t),
                                                0.0)
            for t, i in T.Parallel(_C, K):
                sh.ek[stage, t, i] = T.cast(sh.ek_rows[t] * T.cast(sh.k[stage, t, i], f32), op)
            for t, s in T.Parallel(_C, _C):
                ab[t, s] = sh.m_columns[s] * ab[t, s]
            T.copy(ab, sh.ab[stage, :, :])
            for t, j in T.Parallel(_C, BV):
                sh.dog[stage, t, j] = T.cast(sh.dog_rows[t] * do[t, j], op)
            for t, j in T.Parallel(_C, BV):
                do[t, j] = T.if_then_else(t <= last, do[t, j], 0.0)
            T.copy(do, sh.do[stage, :, :])
            if T.get_thread_binding() == 2 * WARPGROUP:
                sh.chunk_decay[stage] = T.exp2(sh.gamma[stage, _C - 1])
            T.fence_proxy_async()
            T.barrier_arrive(sh.prep_ready[stage])
            T.barrier_arrive(sh.tiles_free[stage])

    @T.macro
    def load_qk_gamma(sh, cta, q, k, gamma, q_rstd, k_rstd):
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            start = cta.chunk_start(c)
            last = T.min(cta.eos - start, _C) - 1
            T.barrier_wait(sh.tiles_free[stage], (c // 2 + 1) % 2)
            T.tma_copy(q[start:start + _C, cta.qk_head, 0:K], sh.q[stage, :, :], barrier=sh.tiles_full[stage])
            T.tma_copy(k[start:start + _C, cta.qk_head, 0:K], sh.k[stage, :, :], barrier=sh.tiles_full[stage])
            # padded rows repeat the last gamma, so e^{gamma_C} is the decay over the real tokens
            for t in T.Parallel(_C):
                sh.gamma[stage, t] = gamma[start + T.min(t, last), cta.head] * LOG2E
            if normalize_qk:  # r by value head: indexed by the CTA's head, as gamma is
                for t in T.Parallel(_C):
                    sh.q_rstd[stage, t] = q_rstd[T.min(start + t, num_tokens - 1), cta.head]
                    sh.k_rstd[stage, t] = k_rstd[T.min(start + t, num_tokens - 1), cta.head]
            T.barrier_arrive(sh.tiles_full[stage])

    @T.macro
    def load_do_products(sh, cta, do, gated_inverse, scores):
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            start = cta.chunk_start(c)
            T.barrier_wait(sh.tiles_free[stage], (c // 2 + 1) % 2)
            T.tma_copy(do[start:start + _C, cta.head, cta.v0:cta.v0 + BV], sh.do[stage, :, :],
                       barrier=sh.tiles_full[stage])
            T.tma_copy(gated_inverse[start:start + _C, cta.head, 0:_C], sh.ab[stage, :, :], barrier=sh.tiles_full[stage])
            T.tma_copy(scores[start:start + _C, cta.head, 0:_C], sh.pm[stage, :, :], barrier=sh.tiles_full[stage])
            T.barrier_arrive(sh.tiles_full[stage])

    @T.macro
    def store_state_grads(sh, cta, chunk_state_grads):
        """dS1 of the piece's own chunks (warm-up chunks belong to the next piece's CTA)."""
        for c in T.serial(cta.n_chunks):
            start = cta.chunk_start(c)
            T.barrier_wait(sh.ds_ready, c % 2)
            if start < cta.piece_end:
                T.copy(sh.ds, chunk_state_grads[cta.first_chunk + (start - cta.bos) // _C, cta.head, 0:K,
                                                cta.v0:cta.v0 + BV])
            T.barrier_arrive(sh.ds_stored)

    @T.prim_func
    def state_grads_roles_kernel(
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
        with T.Kernel(V // BV, num_v_heads, num_pieces, threads=_THREADS) as (vblock, head, piece):
            sequence = piece_table[piece, 0]
            walk_first = piece_table[piece, 1]
            walk_last = walk_end[piece, head]
            n_chunks = T.ceildiv(walk_last - walk_first, _C)
            cta = SimpleNamespace(
                head=head, qk_head=head // (num_v_heads // num_qk_heads), v0=vblock * BV, sequence=sequence,
                bos=cu_seqlens[sequence], eos=cu_seqlens[sequence + 1], first_chunk=chunk_offsets[sequence],
                walk_first=walk_first, walk_last=walk_last, piece_end=piece_table[piece, 2], n_chunks=n_chunks,
                # the c-th chunk walked, in reverse from the walk's last chunk
                chunk_start=lambda c: walk_first + (n_chunks - 1 - c) * _C)
            sh = SimpleNamespace(
                # by chunk parity: filled by the loaders, E K and dOg by the prep role; M and dO_m are written
                # by it over Ab and dO
                q=T.alloc_shared((2, _C, K), op),
                k=T.alloc_shared((2, _C, K), op),
                do=T.alloc_shared((2, _C, BV), op),
                ab=T.alloc_shared((2, _C, _C), op),
                pm=T.alloc_shared((2, _C, _C), op),
                gamma=T.alloc_shared((2, _C), f32),  # log2 units, clamped past the sequence end
                q_rstd=T.alloc_shared((2, _C), f32) if normalize_qk else None,
                k_rstd=T.alloc_shared((2, _C), f32) if normalize_qk else None,
                ek=T.alloc_shared((2, _C, K), op),
                dog=T.alloc_shared((2, _C, BV), op),
                chunk_decay=T.alloc_shared((2,), f32),
                # the prep role's own: each row's factor of E K, dOg, and each column's of M
                ek_rows=T.alloc_shared((_C,), f32),
                dog_rows=T.alloc_shared((_C,), f32),
                m_columns=T.alloc_shared((_C,), f32),
                # single: ordered by the chain
                ds=T.alloc_shared((K, BV), op),
                d_delta=T.alloc_shared((_C, BV), op),
                du=T.alloc_shared((_C, BV), op),
                tiles_full=T.alloc_barrier(arrive_count=[loader_threads] * 2),
                tiles_free=T.alloc_barrier(arrive_count=[reader_threads] * 2),
                prep_ready=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
                ds_ready=T.alloc_barrier(arrive_count=WARPGROUP),
                ds_stored=T.alloc_barrier(arrive_count=32),
                du_ready=T.alloc_barrier(arrive_count=WARPGROUP),
            )
            tx = T.get_thread_binding()
            if tx < WARPGROUP:
                state_role(sh, cta, dht, dh0)
            elif tx < 2 * WARPGROUP:
                delta_role(sh, cta)
            elif tx < 3 * WARPGROUP:
                prep_role(sh, cta, scale)
            else:
                T.set_max_nreg(_PRODUCER_REGISTERS, 0)
                if tx < 3 * WARPGROUP + 32:
                    load_qk_gamma(sh, cta, q, k, gamma, q_rstd, k_rstd)
                elif tx < 3 * WARPGROUP + 64:
                    load_do_products(sh, cta, do, gated_inverse, scores)
                elif tx < 3 * WARPGROUP + 96:
                    store_state_grads(sh, cta, chunk_state_grads)

    return state_grads_roles_kernel


@functools.lru_cache(maxsize=None)
def compile_state_grads_roles(value_block: int = 64, normalize_qk: bool = False):
    return compile_for_hopper(state_grads_roles_program(value_block, normalize_qk), fast_math=True)


def state_gradients_by_roles(q, k, gamma, gated_inverse, scores, do, dht, scale, cu_seqlens, offsets, num_chunks,
                             value_block, pieces: torch.Tensor | None = None, walk_end: torch.Tensor | None = None,
                             rstds: tuple | None = None):
    """backward_state_grads.state_gradients' arguments and outputs, by this kernel. Without pieces every
    sequence is one piece walked from its end."""
    if (pieces is None) != (walk_end is None):
        raise ValueError("state_gradients_by_roles: pass pieces and walk_end together, or neither")
    num_v_heads = do.shape[1]
    num_sequences = cu_seqlens.numel() - 1
    grads, dh0, rstd_operands = walk_operands(q, do, cu_seqlens, num_chunks, rstds)
    if pieces is None:  # (sequence, start, end, ends it) per sequence, walked from its end
        bounds = cu_seqlens.to(torch.int32)
        index = torch.arange(num_sequences, dtype=torch.int32, device=q.device)
        pieces = torch.stack([index, bounds[:-1], bounds[1:], torch.ones_like(index)], 1).contiguous()
        walk_end = bounds[1:, None].expand(num_sequences, num_v_heads).contiguous()
    compile_state_grads_roles(value_block, rstds is not None)(
        q, k, gamma, gated_inverse, scores, do, dht, cu_seqlens, offsets, grads, dh0, pieces, walk_end,
        *rstd_operands, float(scale))
    return grads, dh0
