"""The forward's sequential walk: o, the final state, and for the backward the chunk states
(docs/gdn-math.md §2.3).

One CTA per (piece, value head, V block) walks 64-token chunks in order with the fp32 state S
(K x BV) in registers. Per chunk, with gamma the chunk-local cumsum of g:

    X = Ab V;  Y = (Ab D) K;  Delta = X - Y S0;  O = scale D Q S0 + P Delta;  S1 = e^{gamma_C} S0 + K^T (E Delta)

(Delta = Ab (V - D K S0), docs/gdn-math.md §2.3, with the state's product taken out of the bracket:
X and Y do not depend on S0, so one product a chunk waits for it.)

Ab = Gm * A~ * beta_col and P = scale Gm * tril(Q K^T) are made inside the walk from the gate-free
inverse A~ (inverse.py), so only one [T, Hv, 64] tensor is read besides the
inputs. The work of a chunk is spread over three math warpgroups and a producer warpgroup (512
threads, one CTA per SM):

- warpgroup 0 holds S: writes it to shared memory for the others, decays it, adds K^T (E Delta);
- warpgroup 1 makes the decays, -Ab D (in registers), X, Y, then Delta and E Delta;
- warpgroup 2 makes P and Ab (in place of A~) from one Gm, then O = scale D Q S0 + P Delta;
- warpgroup 3: one warp each loads q/k, v/beta and A~/gamma (double-buffered, TMA for the tiles),
  the fourth stores the chunk states for the backward, then o.

No role waits for a whole chunk to end: the walk's chain is warpgroup 0's copy of S, warpgroup
1's Y S0 and warpgroup 0's update, while warpgroup 2's output and the stores of chunk c
overlap chunk c + 1. Buffers written once a chunk are double-buffered by chunk parity, or have a
`*_free` barrier that their next writer waits on; every mbarrier is one per stage, so none can
complete twice before all its waiters have seen it complete once (each waiter waits before it
releases the stage, and each arriver arrives only after the stage was refilled).

A piece is a run of whole chunks of one sequence (the whole sequence unless it is split for
intra-card context parallelism). Its CTA starts walking at `walk_start` (a chunk boundary at or
before the piece start, from zero state, or from h0 at the sequence start) and writes its outputs
only for the piece's own chunks: the warm-up chunks rebuild the entering state (chunk_plan.py).

Whole 64-row tiles are loaded even past a sequence end (rows of the next sequence, or zeros past
the tensor). Ab and P are lower triangular, so valid rows never read those columns; those rows get
E = 0 and gamma clamped to the sequence's last value, so they never reach valid rows or the state,
and their outputs are not stored.

normalize_qk (the op's use_qk_l2norm_in_kernel): q and k arrive as given, with the L2 norm's r of every row
(inverse.py makes r). Every product with q or k has a diagonal factor beside it already, so r joins that
factor and q^, k^ are never written: r_q the rows of P and of O's state term, r_k the columns of P and of
-Ab D and E's rows in the state update.

Head counts, lengths and the scale are run-time values: one compiled kernel per (V block, dtypes,
what is stored, normalize_qk).
"""

import functools
from types import SimpleNamespace

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import PIECE_FIELDS, chunk_offsets
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, LOG2E, WARPGROUP, compile_for_hopper, dtype_name, times_rstd

_C = CHUNK_SIZE
_THREADS = 4 * WARPGROUP
_MATH_REGISTERS = 152


def _register_split(value_block: int) -> tuple[int, int]:
    """(producer, state warpgroup) registers per thread after setmaxnreg, beside _MATH_REGISTERS for the
    other two: 4 x 128 threads must fit the SM's 64K. S alone takes BV of the state warpgroup's; the
    producer spills below 56 at BV <= 64 (ptxas, sm_90a)."""
    return (40, 168) if value_block > 64 else (56, 152)
MAX_VALUE_BLOCK = 128
# record_timeline: the points of a chunk at which each role's first thread reads the SM's clock (in this
# order in its loop), for the first TIMELINE_CHUNKS chunks of every CTA (tools/walk_timeline.py reads them)
TIMELINE_EVENTS = {
    "state": ("top", "tiles", "state_free", "state_handed", "decays", "delta_ready", "updated"),
    "delta": ("top", "tiles", "decays", "neg_ab_d", "neg_y", "delta_free", "neg_y_stored", "ab_ready", "x",
              "state_ready", "y_s0", "delta_handed"),
    "output": ("top", "tiles", "qk", "gm", "a_read", "ab_handed", "p_stored", "state_ready", "q_s0", "decays",
               "delta_ready", "p_delta", "o_free", "o_handed"),
    "store": ("top", "state_ready", "state_stored", "o_ready", "o_stored"),
}
TIMELINE_CHUNKS = 64
_TIMELINE_SLOTS = max(len(events) for events in TIMELINE_EVENTS.values())
_ROLE_LEADERS = {"state": 0, "delta": WARPGROUP, "output": 2 * WARPGROUP, "store": 3 * WARPGROUP + 96}


def fused_forward_program(value_block: int, dtype: str = "bfloat16", beta_dtype: str = "float32",
                                 head_dim: int = HEAD_DIM, store_chunk_states: bool = False,
                                 record_timeline: bool = False, normalize_qk: bool = False):
    """record_timeline: also write the clock at every TIMELINE_EVENTS point (a diagnostic: same outputs).
    normalize_qk: q and k are the L2 norm's inputs, q_rstd and k_rstd its r (else they are not read)."""
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_pieces = T.dynamic("num_pieces")
    num_chunks = T.dynamic("num_chunks")
    timeline_ctas = T.dynamic("timeline_ctas")
    rstd_rows = T.dynamic("rstd_rows")
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    K = head_dim
    BV = value_block
    value_blocks = head_dim // BV
    producer_registers, state_registers = _register_split(BV)
    # Producer warps arrive on `tiles_full`; every consumer thread and the store warp on `tiles_free`.
    loader_threads = 3 * 32
    reader_threads = 3 * WARPGROUP + 32

    def neg_y_tile(sh):
        return sh.delta if sh.neg_y is None else sh.neg_y

    @T.macro
    def stamp(timeline, cta, role, c, event):
        if record_timeline:
            if T.get_thread_binding() == _ROLE_LEADERS[role] and c < TIMELINE_CHUNKS:
                timeline[cta.index, list(TIMELINE_EVENTS).index(role), c,
                         TIMELINE_EVENTS[role].index(event)] = T.call_extern("int64", "clock64")

    # Each role is a macro: written inline, the branches nest deeper than Python allows.
    @T.macro
    def state_warpgroup(sh, cta, initial_state, final_state, timeline):
        """Warpgroup 0: S in registers; hands S0 to the others, then S1 = e^{gamma_C} S0 + K^T (E Delta)."""
        T.set_max_nreg(state_registers, 1)
        state = T.alloc_fragment((K, BV), "float32")
        chunk_decay = T.alloc_var("float32")
        if cta.use_initial_state != 0 and cta.walk == cta.seq_start:
            T.copy(initial_state[cta.sequence, cta.head, 0:K, cta.v0:cta.v0 + BV], state)
        else:
            T.clear(state)
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            stamp(timeline, cta, "state", c, "top")
            T.barrier_wait(sh.tiles_full[stage], (c // 2) % 2)
            stamp(timeline, cta, "state", c, "tiles")
            if c > 0:
                T.barrier_wait(sh.state_free[1 - stage], ((c - 1) // 2) % 2)
            stamp(timeline, cta, "state", c, "state_free")
            T.copy(state, sh.state)
            T.fence_proxy_async()
            T.barrier_arrive(sh.state_ready[stage])
            stamp(timeline, cta, "state", c, "state_handed")
            T.barrier_wait(sh.decays_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "state", c, "decays")
            chunk_decay = sh.row_decay[stage, _C - 1]
            for i, j in T.Parallel(K, BV):
                state[i, j] = state[i, j] * chunk_decay
            T.barrier_wait(sh.delta_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "state", c, "delta_ready")
            T.gemm(sh.k[stage, :, :], sh.decayed_delta, state, transpose_A=True)
            stamp(timeline, cta, "state", c, "updated")
            T.barrier_arrive(sh.tiles_free[stage])
        if cta.ends_sequence != 0:
            T.copy(state, final_state[cta.sequence, cta.head, 0:K, cta.v0:cta.v0 + BV])

    @T.macro
    def delta_warpgroup(sh, cta, timeline):
        """Warpgroup 1: the decays; -Y = -(Ab D) K and X = Ab V before S0 arrives, then Delta = X - Y S0 and
        E Delta. Ab D = D A~ Bt (no e^{-gamma}) is made here from A~, in registers; Ab comes from warpgroup 2.
        -Y waits in Delta's buffer at BV = K, where shared memory has no room for another tile."""
        T.set_max_nreg(_MATH_REGISTERS, 1)
        delta = T.alloc_fragment((_C, BV), "float32")
        neg_y = T.alloc_fragment((_C, K), "float32")
        decayed_ab = T.alloc_fragment((_C, _C), dtype)
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            last = T.min(cta.end - (cta.walk + c * _C), _C) - 1
            stamp(timeline, cta, "delta", c, "top")
            T.barrier_wait(sh.tiles_full[stage], (c // 2) % 2)
            stamp(timeline, cta, "delta", c, "tiles")
            for t in T.Parallel(_C):
                sh.row_decay[stage, t] = T.exp2(sh.gamma[stage, t])
                sh.end_decay[stage, t] = T.if_then_else(
                    t <= last, times_rstd(T.exp2(sh.gamma[stage, _C - 1] - sh.gamma[stage, t]), sh.k_rstd, stage, t), 0.0)
            T.barrier_arrive(sh.decays_ready[stage])
            T.barrier_wait(sh.decays_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "delta", c, "decays")
            T.copy(sh.a[stage, :, :], decayed_ab)
            T.barrier_arrive(sh.a_read[stage])   # warpgroup 2 may write Ab over A~
            # every element first, the causal mask after: the loads are then unconditional, so each thread
            # reads each gamma and beta it needs once (a masked expression loads under the mask, element by element)
            for t, s in T.Parallel(_C, _C):
                decayed_ab[t, s] = -sh.row_decay[stage, t] * times_rstd(sh.beta[stage, s], sh.k_rstd, stage, s) * decayed_ab[t, s]
            for t, s in T.Parallel(_C, _C):
                decayed_ab[t, s] = T.Select(s <= t, decayed_ab[t, s], T.cast(0, dtype))
            stamp(timeline, cta, "delta", c, "neg_ab_d")
            T.fence_proxy_async()
            T.gemm(decayed_ab, sh.k[stage, :, :], neg_y, clear_accum=True)
            stamp(timeline, cta, "delta", c, "neg_y")
            # Delta's buffer is free once warpgroup 2 has read the chunk before's (and warpgroup 0
            # finished reading E Delta before it handed out this chunk's S0).
            if c > 0:
                T.barrier_wait(sh.delta_free[1 - stage], ((c - 1) // 2) % 2)
            stamp(timeline, cta, "delta", c, "delta_free")
            T.copy(neg_y, neg_y_tile(sh))
            stamp(timeline, cta, "delta", c, "neg_y_stored")
            T.fence_proxy_async()
            T.barrier_wait(sh.ab_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "delta", c, "ab_ready")
            T.gemm(sh.a[stage, :, :], sh.v[stage, :, :], delta, clear_accum=True)
            stamp(timeline, cta, "delta", c, "x")
            T.barrier_wait(sh.state_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "delta", c, "state_ready")
            T.gemm(neg_y_tile(sh), sh.state, delta)
            stamp(timeline, cta, "delta", c, "y_s0")
            T.copy(delta, sh.delta)
            for t, j in T.Parallel(_C, BV):
                delta[t, j] = delta[t, j] * sh.end_decay[stage, t]
            T.copy(delta, sh.decayed_delta)
            T.fence_proxy_async()
            T.barrier_arrive(sh.delta_ready[stage])
            stamp(timeline, cta, "delta", c, "delta_handed")
            T.barrier_arrive(sh.tiles_free[stage])

    @T.macro
    def output_warpgroup(sh, cta, timeline):
        """Warpgroup 2: P and Ab, from one Gm; then O = scale D Q S0 + P Delta. (Ab is made here, where
        the wait for Delta leaves time, rather than on warpgroup 1, the walk's busiest.)"""
        T.set_max_nreg(_MATH_REGISTERS, 1)
        qk = T.alloc_fragment((_C, _C), "float32")
        out = T.alloc_fragment((_C, BV), "float32")
        ab = T.alloc_fragment((_C, _C), "float32")
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            stamp(timeline, cta, "output", c, "top")
            T.barrier_wait(sh.tiles_full[stage], (c // 2) % 2)
            stamp(timeline, cta, "output", c, "tiles")
            T.copy(sh.a[stage, :, :], ab)
            T.gemm(sh.q[stage, :, :], sh.k[stage, :, :], qk, transpose_B=True, clear_accum=True)
            stamp(timeline, cta, "output", c, "qk")
            # In registers, then stored whole: stored element by element, each store kept the next element's
            # gamma loads behind it (the compiler cannot tell the buffers apart: 3.3k cycles of a 7k chunk).
            # Every element first, the causal mask after, so the loads are unconditional. ab takes qk's layout.
            for t, s in T.Parallel(_C, _C):
                qk[t, s] = T.exp2(sh.gamma[stage, t] - sh.gamma[stage, s]) * times_rstd(
                    times_rstd(cta.scale, sh.q_rstd, stage, t), sh.k_rstd, stage, s) * qk[t, s]
                ab[t, s] = T.exp2(sh.gamma[stage, t] - sh.gamma[stage, s]) * sh.beta[stage, s] * ab[t, s]
            for t, s in T.Parallel(_C, _C):
                qk[t, s] = T.Select(s <= t, qk[t, s], 0.0)
                ab[t, s] = T.Select(s <= t, ab[t, s], 0.0)
            stamp(timeline, cta, "output", c, "gm")
            T.barrier_wait(sh.a_read[stage], (c // 2) % 2)   # warpgroup 1 has read A~
            stamp(timeline, cta, "output", c, "a_read")
            T.copy(ab, sh.a[stage, :, :])
            T.fence_proxy_async()
            T.barrier_arrive(sh.ab_ready[stage])
            stamp(timeline, cta, "output", c, "ab_handed")
            T.copy(qk, sh.p[stage, :, :])
            T.fence_proxy_async()
            stamp(timeline, cta, "output", c, "p_stored")
            T.barrier_wait(sh.state_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "output", c, "state_ready")
            T.gemm(sh.q[stage, :, :], sh.state, out, clear_accum=True)
            stamp(timeline, cta, "output", c, "q_s0")
            T.barrier_arrive(sh.state_free[stage])
            T.barrier_wait(sh.decays_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "output", c, "decays")
            for t, j in T.Parallel(_C, BV):
                out[t, j] = out[t, j] * (sh.row_decay[stage, t] * times_rstd(cta.scale, sh.q_rstd, stage, t))
            T.barrier_wait(sh.delta_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "output", c, "delta_ready")
            T.gemm(sh.p[stage, :, :], sh.delta, out)
            stamp(timeline, cta, "output", c, "p_delta")
            T.barrier_arrive(sh.delta_free[stage])
            if c > 0:
                T.barrier_wait(sh.o_free[1 - stage], ((c - 1) // 2) % 2)
            stamp(timeline, cta, "output", c, "o_free")
            T.copy(out, sh.o)
            T.fence_proxy_async()
            T.barrier_arrive(sh.o_ready[stage])
            stamp(timeline, cta, "output", c, "o_handed")
            T.barrier_arrive(sh.tiles_free[stage])

    @T.macro
    def load_qk(sh, cta, q, k, q_rstd_rows, k_rstd_rows):
        if normalize_qk:  # held in a variable: inlined into the r loads' indices it is a 64-bit division
            qk_head = T.alloc_var("int32")
            qk_head = cta.qk_head
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            left = cta.walk + c * _C
            T.barrier_wait(sh.tiles_free[stage], (c // 2 + 1) % 2)
            T.tma_copy(q[left:left + _C, cta.qk_head, 0:K], sh.q[stage, :, :], barrier=sh.tiles_full[stage])
            T.tma_copy(k[left:left + _C, cta.qk_head, 0:K], sh.k[stage, :, :], barrier=sh.tiles_full[stage])
            if normalize_qk:  # each row's own r (rows past the tensor are TMA's zeros)
                for t in T.Parallel(_C):
                    sh.q_rstd[stage, t] = q_rstd_rows[T.min(left + t, num_tokens - 1), qk_head]
                    sh.k_rstd[stage, t] = k_rstd_rows[T.min(left + t, num_tokens - 1), qk_head]
            T.barrier_arrive(sh.tiles_full[stage])

    @T.macro
    def load_v_beta(sh, cta, v, beta):
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            left = cta.walk + c * _C
            last = T.min(cta.end - left, _C) - 1
            T.barrier_wait(sh.tiles_free[stage], (c // 2 + 1) % 2)
            T.tma_copy(v[left:left + _C, cta.head, cta.v0:cta.v0 + BV], sh.v[stage, :, :],
                       barrier=sh.tiles_full[stage])
            for t in T.Parallel(_C):
                sh.beta[stage, t] = T.cast(beta[left + T.min(t, last), cta.head], "float32")
            T.barrier_arrive(sh.tiles_full[stage])

    @T.macro
    def load_inverse_gamma(sh, cta, inverse, gamma):
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            left = cta.walk + c * _C
            last = T.min(cta.end - left, _C) - 1
            T.barrier_wait(sh.tiles_free[stage], (c // 2 + 1) % 2)
            T.tma_copy(inverse[left:left + _C, cta.head, 0:_C], sh.a[stage, :, :], barrier=sh.tiles_full[stage])
            for t in T.Parallel(_C):
                sh.gamma[stage, t] = gamma[left + T.min(t, last), cta.head] * LOG2E
            T.barrier_arrive(sh.tiles_full[stage])

    @T.macro
    def store_outputs(sh, cta, o, chunk_states, timeline):
        """The store warp: o and the chunk states of the piece's own chunks."""
        for c in T.serial(cta.n_chunks):
            stage = c % 2
            left = cta.walk + c * _C
            last = T.min(cta.end - left, _C) - 1
            own = left >= cta.piece_start
            stamp(timeline, cta, "store", c, "top")
            T.barrier_wait(sh.state_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "store", c, "state_ready")
            if store_chunk_states and own:
                T.copy(sh.state, chunk_states[cta.first_chunk + (left - cta.seq_start) // _C, cta.head,
                                              0:K, cta.v0:cta.v0 + BV])
            T.barrier_arrive(sh.state_free[stage])
            stamp(timeline, cta, "store", c, "state_stored")
            T.barrier_wait(sh.o_ready[stage], (c // 2) % 2)
            stamp(timeline, cta, "store", c, "o_ready")
            if own and left + _C <= cta.end:
                T.copy(sh.o, o[left:left + _C, cta.head, cta.v0:cta.v0 + BV])
            if own and left + _C > cta.end:
                for t, j in T.Parallel(_C, BV):
                    if t <= last:
                        o[left + t, cta.head, cta.v0 + j] = sh.o[t, j]
            T.barrier_arrive(sh.o_free[stage])
            stamp(timeline, cta, "store", c, "o_stored")
            T.barrier_arrive(sh.tiles_free[stage])

    @T.prim_func
    def fused_forward_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, K), dtype),
        v: T.Tensor((num_tokens, num_v_heads, head_dim), dtype),
        gamma: T.Tensor((num_tokens, num_v_heads), "float32"),
        beta: T.Tensor((num_tokens, num_v_heads), beta_dtype),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), dtype),
        initial_state: T.Tensor((num_sequences, num_v_heads, K, head_dim), "float32"),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        pieces: T.Tensor((num_pieces, PIECE_FIELDS), "int32"),
        walk_start: T.Tensor((num_pieces, num_v_heads), "int32"),
        o: T.Tensor((num_tokens, num_v_heads, head_dim), dtype),
        final_state: T.Tensor((num_sequences, num_v_heads, K, head_dim), "float32"),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, head_dim), dtype),
        timeline: T.Tensor((timeline_ctas, len(TIMELINE_EVENTS), TIMELINE_CHUNKS, _TIMELINE_SLOTS), "int64"),
        q_rstd_rows: T.Tensor((rstd_rows, num_qk_heads), "float32"),
        k_rstd_rows: T.Tensor((rstd_rows, num_qk_heads), "float32"),
        scale: T.float32,
        use_initial_state: T.int32,
    ):
        with T.Kernel(value_blocks, num_v_heads, num_pieces, threads=_THREADS) as (vb, head, piece):
            sequence = pieces[piece, 0]
            walk = walk_start[piece, head]
            cta = SimpleNamespace(
                vb=vb, head=head, qk_head=head // (num_v_heads // num_qk_heads), v0=vb * BV, sequence=sequence,
                piece_start=pieces[piece, 1], end=pieces[piece, 2], ends_sequence=pieces[piece, 3], walk=walk,
                n_chunks=T.ceildiv(pieces[piece, 2] - walk, _C), first_chunk=chunk_offsets[sequence],
                seq_start=cu_seqlens[sequence], scale=scale, use_initial_state=use_initial_state,
                index=(piece * num_v_heads + head) * value_blocks + vb)
            sh = SimpleNamespace(
                # Double-buffered: filled by the producer warps for chunk c into stage c % 2, or written
                # in chunk c by the warpgroups; refilled only after every role released the stage.
                q=T.alloc_shared((2, _C, K), dtype),
                k=T.alloc_shared((2, _C, K), dtype),
                v=T.alloc_shared((2, _C, BV), dtype),
                a=T.alloc_shared((2, _C, _C), dtype),           # A~, then Ab in place
                gamma=T.alloc_shared((2, _C), "float32"),       # log2 units, clamped past the end
                beta=T.alloc_shared((2, _C), "float32"),
                p=T.alloc_shared((2, _C, _C), dtype),
                row_decay=T.alloc_shared((2, _C), "float32"),
                end_decay=T.alloc_shared((2, _C), "float32"),
                q_rstd=T.alloc_shared((2, _C), "float32") if normalize_qk else None,
                k_rstd=T.alloc_shared((2, _C), "float32") if normalize_qk else None,
                # Single: each has a *_free barrier its next writer waits on (E Delta's: state_ready).
                state=T.alloc_shared((K, BV), dtype),
                delta=T.alloc_shared((_C, BV), dtype),
                decayed_delta=T.alloc_shared((_C, BV), dtype),
                o=T.alloc_shared((_C, BV), dtype),
                # -Y (warpgroup 1) where Delta's buffer is too narrow for it
                neg_y=T.alloc_shared((_C, K), dtype) if BV < K else None,
                # Per stage, so that one completes once per two chunks, after all its waiters of the
                # chunk before released the stage (tiles_free): no waiter can miss a phase.
                tiles_full=T.alloc_barrier(arrive_count=[loader_threads] * 2),
                tiles_free=T.alloc_barrier(arrive_count=[reader_threads] * 2),
                state_ready=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
                state_free=T.alloc_barrier(arrive_count=[WARPGROUP + 32] * 2),   # warpgroup 2, store warp
                decays_ready=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
                delta_ready=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
                delta_free=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
                o_ready=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
                o_free=T.alloc_barrier(arrive_count=[32] * 2),
                a_read=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),           # warpgroup 1 has read A~
                ab_ready=T.alloc_barrier(arrive_count=[WARPGROUP] * 2),
            )
            tx = T.get_thread_binding()
            if tx < WARPGROUP:
                state_warpgroup(sh, cta, initial_state, final_state, timeline)
            elif tx < 2 * WARPGROUP:
                delta_warpgroup(sh, cta, timeline)
            elif tx < 3 * WARPGROUP:
                output_warpgroup(sh, cta, timeline)
            else:
                T.set_max_nreg(producer_registers, 0)
                if tx < 3 * WARPGROUP + 32:
                    load_qk(sh, cta, q, k, q_rstd_rows, k_rstd_rows)
                elif tx < 3 * WARPGROUP + 64:
                    load_v_beta(sh, cta, v, beta)
                elif tx < 3 * WARPGROUP + 96:
                    load_inverse_gamma(sh, cta, inverse, gamma)
                else:
                    store_outputs(sh, cta, o, chunk_states, timeline)

    return fused_forward_kernel


@functools.lru_cache(maxsize=None)
def compile_fused_forward(value_block: int, dtype: str = "bfloat16", beta_dtype: str = "float32",
                                 head_dim: int = HEAD_DIM, store_chunk_states: bool = False,
                                 record_timeline: bool = False, normalize_qk: bool = False):
    program = fused_forward_program(value_block, dtype, beta_dtype, head_dim, store_chunk_states,
                                           record_timeline, normalize_qk)
    return compile_for_hopper(program, fast_math=True)


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor,
                         beta: torch.Tensor, inverse: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
                         cu_seqlens: torch.Tensor, value_block: int, pieces: torch.Tensor, walk_start: torch.Tensor,
                         store_chunk_states: bool = False,
                         offsets: torch.Tensor | None = None, num_chunks: int | None = None,
                         timeline: torch.Tensor | None = None, rstds: tuple | None = None):
    """(o, final_state, chunk_states or None) on flattened inputs.

    q, k: [T, Hqk, K]; v: [T, Hv, V]; gamma (fp32 chunk-local cumsum), beta: [T, Hv]; inverse: the
    gate-free A~, [T, Hv, 64] in q's dtype; initial_state: [N, Hv, K, V] fp32 or None; cu_seqlens:
    int32 [N+1]; pieces, walk_start: from chunk_plan.plan_pieces / walk_bounds; value_block: the plan's.
    store_chunk_states: also return the state entering every chunk, [num_chunks, Hv, K, V] in v's
    dtype (chunk c of sequence n at row offsets[n] + c); in a split sequence each piece's states come
    from its own (warm-up) walk. num_chunks: offsets' last entry when the caller knows it.
    timeline: int64 [CTAs, 4, TIMELINE_CHUNKS, slots] (timeline_shape) to fill with the clock at each role's
    TIMELINE_EVENTS (the kernel built with record_timeline; tools/walk_timeline.py). Outputs are unchanged.
    rstds: (q_rstd, k_rstd), float32 [T, Hqk] each, when q and k are the inputs of use_qk_l2norm_in_kernel's
    norm and these its r (inverse.gamma_and_inverse(normalize_q=...)); the walk is then that of q^, k^.
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
    if timeline is None:
        clock = _unrecorded_timeline(device)
    else:
        expected = timeline_shape(pieces.shape[0], num_v_heads, value_block)
        if tuple(timeline.shape) != expected or timeline.dtype != torch.int64:
            raise ValueError(f"fused_forward: timeline must be int64 {list(expected)}, got {timeline.dtype} "
                             f"{list(timeline.shape)}")
        clock = timeline
    kernel = compile_fused_forward(value_block, dtype_name(v), dtype_name(beta), head_dim,
                                          store_chunk_states, timeline is not None, rstds is not None)
    if rstds is None:
        rstds = (_unread_rstds(device, num_qk_heads),) * 2
    kernel(q, k, v, gamma, beta, inverse, initial_state, cu_seqlens, offsets, pieces, walk_start, o, final_state,
           states, clock, *rstds, float(scale), int(use_initial_state))
    return o, final_state, states if store_chunk_states else None


@functools.cache
def _unrecorded_timeline(device: torch.device) -> torch.Tensor:
    """The timeline argument of the walk that records none: one CTA's worth, never written, made once
    per device rather than on every call."""
    return torch.empty(1, len(TIMELINE_EVENTS), TIMELINE_CHUNKS, _TIMELINE_SLOTS, dtype=torch.int64, device=device)


@functools.cache
def _unread_rstds(device: torch.device, num_qk_heads: int) -> torch.Tensor:
    """The r arguments of the walk without normalize_qk: one row, never read."""
    return torch.empty(1, num_qk_heads, dtype=torch.float32, device=device)


def timeline_shape(num_pieces: int, num_v_heads: int, value_block: int) -> tuple[int, int, int, int]:
    """fused_forward's timeline: (CTA = (piece * Hv + head) * V blocks + V block, role in TIMELINE_EVENTS'
    order, chunk, event)."""
    return (num_pieces * num_v_heads * (HEAD_DIM // value_block), len(TIMELINE_EVENTS), TIMELINE_CHUNKS,
            _TIMELINE_SLOTS)
