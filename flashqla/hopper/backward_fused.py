"""The backward in one reverse walk (the op's since the fortieth session; docs/kernel-notes.md): the state
gradient of docs/gdn-math.md §3.1 held on chip while the chunk gradients of §3.2-3.3 are made as it
walks, so dS never goes through HBM and q, k, dO are read once.

One CTA per (piece, value head), all 128 V columns, 512 threads in four roles that meet on mbarriers:

- state (warpgroup 0): dS (K x V, float32, in registers). A chunk: hands dS1 over as bf16, makes
  dOg = scale D r_q dO, then dS0 = e^{gamma_C} dS1 + Q^T dOg + K^T dU (dU = -D r_k dW); the chunk's dg and
  dbeta where it would wait anyway: the column sums of two float32 tiles from the products role while the next
  chunk's q, k load, <S0, dS1>, dg's suffix sums and the stores while the delta role makes that chunk's dU;
- delta (warpgroup 1), the state's partner on the chain: U = K S0, W = V - D U (in v's buffer),
  Delta = Ab W; Pm^T dO before dS1 arrives, then dDelta = E K dS1 + Pm^T dO, dW = Ab^T dDelta (= dv),
  dU; off the chain dk = E Delta dS1^T + dU S0^T + dPm^T Q + (X + X^T) K and dgamma's D and E terms, and
  between dk's state and C x C terms dq = scale D dO S0^T + dPm K in two halves of its columns (a 64 x 128
  fragment beside dk's would spill); dq and dk leave through Delta's buffer by TMA stores (store_rows), dv
  through dDelta's once the products role's dAb has read it;
- products (warpgroup 2): Pm and Ab from Q K^T, A~ and one Gm for the others; the C x C half of
  the gradients (dP, dAb, dA~, T1, dL, dPm, X), the row sums of dg and dbeta, and the C x C tiles whose column
  sums they need, in float32 in the bytes of dDelta and W (both read by then);
- loads (warpgroup 3): one warp each for q/k with gamma, beta, the decays and r; A~; v and S0; dO.

Chunks are walked in lock-step: every shared buffer is single (227 KB hold one chunk's worth), each
refilled or rewritten once all its readers released it; every barrier completes once a chunk, is
arrived for chunk c only after its arrivers waited on what its waiters release after chunk c - 1, and
is waited on in every chunk (warm-up chunks skip the work, not the barriers), so none can run two
phases ahead of a waiter.

With the L2 norm (q^ = diag(r_q) q, k^ = diag(r_k) k, r per row) dq and dk are accumulated as r_q dq and r_k dk
and divided once at the end: then one tile Z = diag(r_q) dPm diag(r_k) serves both dq (Z K) and dk (Z^T Q), and
one Y = diag(r_k) X diag(r_k) both of dk's X terms (Y K, Y^T K), where r on one side only would need a second
tile for each (and shared memory has no room for it).

dgamma's D and E terms come without U: rowsum(dU . U) - te = rowsum(K . (dU S0^T)) - rowsum(K . E Delta
dS1^T) (both sides expand to sums over K S0 and K dS1), and those two products are dk's state terms.

Pieces: a piece's CTA starts at walk_end (its sequence end, from dht, or a chunk boundary after the
piece, from zero: the decay-truncated warm-up of walk_bounds.py) and makes gradients only for its own
chunks; warm-up chunks run the state chain only (Pm, Ab, dOg, dDelta, dU).
"""

import functools
from types import SimpleNamespace

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import PIECE_FIELDS
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, WARPGROUP, compile_for_hopper, times_rstd

_C = CHUNK_SIZE
_THREADS = 4 * WARPGROUP
# registers a thread after setmaxnreg: state, delta, products, loads (4 x 128 threads share 64K)
_REGISTERS = (160, 168, 152, 32)
# a candidate's budget (fused_backward_program's registers): the loads role at setmaxnreg's floor, its 8 to the
# delta role, which sets the chunk period (docs/kernel-notes.md)
DELTA_HEAVY_REGISTERS = (160, 176, 152, 24)
# record_timeline: the points of a chunk at which each role's first thread reads the SM's clock, in loop order,
# for the first TIMELINE_CHUNKS chunks of every CTA (tools/walk_timeline.py --backward summarises them)
TIMELINE_EVENTS = {
    "state": ("top", "ds_free", "ds_handed", "cc_ready", "colsums", "tiles", "dog_made", "q_dog", "rows_ready",
              "epilogue", "du_ready", "k_du"),
    "delta": ("top", "tiles", "products", "delta", "delta_handed", "pm_do", "ds_ready", "dd_handed", "dw", "du_handed",
              "dk_state", "vg_stored", "dpm_ready", "dq", "vg_handed", "zq", "x_ready", "qk_released", "dk_stored"),
    "products": ("top", "tiles", "products", "delta_ready", "dp", "z_handed", "dd_ready", "dab",
                 "dd_read", "cc_handed", "t1_dl", "dpm_read", "y_handed"),
    "loads": ("qk_free", "issued"),
}
TIMELINE_CHUNKS = 64
_TIMELINE_SLOTS = max(len(events) for events in TIMELINE_EVENTS.values())
# a named barrier of the delta role's own (TileLang numbers its per-role barriers from 3 up, one each)
_DELTA_BARRIER = 12
_ROLE_LEADERS = {"state": 0, "delta": WARPGROUP, "products": 2 * WARPGROUP, "loads": 3 * WARPGROUP}


def fused_backward_program(normalize_qk: bool = False, record_timeline: bool = False, l2norm_backward: bool = False,
                           registers: tuple[int, int, int, int] = _REGISTERS):
    """record_timeline: also write the clock at every TIMELINE_EVENTS point (a diagnostic: same outputs).
    l2norm_backward (with normalize_qk): dq and dk come out as the gradients of q and k, the norm's backward
    applied on chip, for layouts where a value head has its own q, k head (else the group is summed first,
    outside).
    registers: each role's registers a thread (state, delta, products, loads; DELTA_HEAVY_REGISTERS is a
    candidate's): the first three raised from the 128 a thread starts with, the loads' lowered, multiples of 8
    that fit the SM's 64K."""
    if l2norm_backward and not normalize_qk:
        raise ValueError("fused_backward_program: l2norm_backward needs normalize_qk (the norm's r)")
    if not (len(registers) == 4 and all(n % 8 == 0 for n in registers) and all(128 <= n <= 256 for n in registers[:3])
            and 24 <= registers[3] <= 128 and WARPGROUP * sum(registers) <= 65536):
        raise ValueError(f"fused_backward_program: registers must be 4 multiples of 8, the first three in [128, 256], "
                         f"the last in [24, 128], summing to at most {65536 // WARPGROUP}; got {registers}")
    K = V = HEAD_DIM
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_tokens = T.dynamic("num_tokens")
    num_sequences = T.dynamic("num_sequences")
    num_chunks = T.dynamic("num_chunks")
    num_pieces = T.dynamic("num_pieces")
    rstd_rows = T.dynamic("rstd_rows")
    timeline_ctas = T.dynamic("timeline_ctas")
    op = "bfloat16"
    f32 = "float32"

    @T.macro
    def stamp(cta, role, c, event):
        if record_timeline:
            if T.get_thread_binding() == _ROLE_LEADERS[role] and c < TIMELINE_CHUNKS:
                cta.timeline[cta.index, list(TIMELINE_EVENTS).index(role), c,
                             TIMELINE_EVENTS[role].index(event)] = T.call_extern("int64", "clock64")

    def rq(sh):
        return sh.q_rstd if normalize_qk else None

    def rk(sh):
        return sh.k_rstd if normalize_qk else None

    @T.macro
    def state_sync(sh, parity):
        """A barrier among the state role's 128 threads (an mbarrier: no block-wide barrier may run while the
        other roles walk); parity: how many it has completed before, mod 2."""
        T.barrier_arrive(sh.state_sync[0])
        T.barrier_wait(sh.state_sync[0], parity)

    @T.macro
    def column_sums(sh, cta, c, own, lane, col):
        """The first half of chunk c's dg and dbeta, by the state role off the products role's path: the column
        sums of the products role's two float32 tiles (a column a thread: threads 0-63 the dgamma tile, 64-127 the
        dbeta tile) into col[0]. own: a run-time bool. Releases dDelta's and W's bytes, which the tiles borrowed."""
        T.barrier_wait(sh.cc_ready[0], c % 2)
        stamp(cta, "state", c + 1, "cc_ready")
        if own:
            col[0] = 0.0
            if lane < _C:
                for r in T.unroll(_C):
                    col[0] = col[0] + sh.cc_gam[r, lane]
            else:
                for r in T.unroll(_C):
                    col[0] = col[0] + sh.cc_beta[r, lane - _C]
        T.barrier_arrive(sh.dd_free[0])
        T.barrier_arrive(sh.vs_free[0])
        stamp(cta, "state", c + 1, "colsums")

    @T.macro
    def chunk_epilogue(sh, cta, c, own, lane, col, chunk_decay, dg, dbeta):
        """The rest of chunk c's dg and dbeta, after column_sums: dbeta_t = col + the row sums, and dg_t =
        e^{gamma_C} <S0, dS1> + sum te + sum_{j >= t} dgamma_j. Run where the state role would wait for dU anyway,
        after it released dOg's buffer: on the chain it delayed dU. Two state_sync a call, so their parities are
        fixed."""
        suffix = T.alloc_var(f32)
        shifted = T.alloc_var(f32)
        te_sum = T.alloc_var(f32)
        total = T.alloc_var(f32)
        start = cta.start_of(c)
        length = T.min(cta.eos - start, _C)
        T.barrier_wait(sh.rows_ready[0], c % 2)
        T.barrier_wait(sh.vg_ready[0], c % 2)
        stamp(cta, "state", c + 1, "rows_ready")
        if own:
            # suffix sums by shuffles in the first two warps (a row a thread), warp 0 then adds warp 1's total: a
            # fixed order, deterministic
            if lane < _C:
                suffix = T.if_then_else(lane < length, sh.dgam_rows[lane] + sh.dgam_v[lane] - col[0], 0.0)
                for o in T.unroll(5):
                    shifted = T.shfl_down(suffix, 1 << o)
                    suffix = suffix + T.if_then_else(lane % 32 + (1 << o) < 32, shifted, 0.0)
                te_sum = T.warp_reduce_sum(sh.te[lane])
                if lane % 32 == 0:
                    sh.suffix_part[lane // 32] = suffix
                    sh.te_part[lane // 32] = te_sum
            elif lane - _C < length:
                dbeta[start + lane - _C, cta.head] = col[0] + sh.dbeta_rows[lane - _C]
            state_sync(sh, 0)
            if lane < length:
                total = (sh.dot_part[0] + sh.dot_part[1] + sh.dot_part[2] + sh.dot_part[3]) * chunk_decay
                total = total + sh.te_part[0] + sh.te_part[1] + suffix
                total = total + T.if_then_else(lane < 32, sh.suffix_part[1], 0.0)
                dg[start + lane, cta.head] = total
            state_sync(sh, 1)
        T.barrier_arrive(sh.vg_free[0])
        T.barrier_arrive(sh.rows_free[0])
        stamp(cta, "state", c + 1, "epilogue")

    @T.macro
    def state_dot(sh, lane):
        """<S0, dS1> of the chunk for dg's e^{gamma_C} term, from the bf16 dS1 this role handed over and S0 (both
        kept until this role's next turn), where it waits for dU anyway: a row a thread into one sum (dS's fragment
        leaves few registers), then a warp sum into dot_part, which chunk_epilogue reads after a state_sync."""
        dot = T.alloc_var(f32)
        dot = 0.0
        for b in T.serial(V // 8):
            for j in T.unroll(8):
                dot = dot + T.cast(sh.s0[lane, b * 8 + j], f32) * T.cast(sh.ds[lane, b * 8 + j], f32)
        dot = T.warp_reduce_sum(dot)
        if lane % 32 == 0:
            sh.dot_part[lane // 32] = dot

    @T.macro
    def state_role(sh, cta, dht, dh0, dg, dbeta):
        T.set_max_nreg(registers[0], 1)
        lane = T.get_thread_binding()
        chunk_decay = T.alloc_var(f32)  # e^{gamma_C} of the chunk, kept for its epilogue (the loads refill dec)
        chunk_decay = 1.0
        decay_before = T.alloc_var(f32)  # the chunk before's, for its epilogue in this chunk's turn
        col = T.alloc_local((1,), f32)  # a thread's column sum, from column_sums to chunk_epilogue
        ds = T.alloc_fragment((K, V), f32)
        if cta.walk_last == cta.eos:
            T.copy(dht[cta.seq, cta.head, 0:K, 0:V], ds)
        else:  # truncated: what comes after the warm-up is below e^threshold
            T.clear(ds)
        for c in T.serial(cta.n_chunks):
            stamp(cta, "state", c, "top")
            if c > 0:
                T.barrier_wait(sh.ds_free[0], (c - 1) % 2)
            stamp(cta, "state", c, "ds_free")
            T.copy(ds, sh.ds)
            T.fence_proxy_async()
            T.barrier_arrive(sh.ds_ready[0])
            stamp(cta, "state", c, "ds_handed")
            if c > 0:  # the chunk before's dg and dbeta begin while this chunk's q, k load
                column_sums(sh, cta, c - 1, c - 1 >= cta.n_warm, lane, col)
            T.barrier_wait(sh.qk_full[0], c % 2)
            stamp(cta, "state", c, "tiles")
            decay_before = chunk_decay
            chunk_decay = sh.dec[_C - 1]
            for i, j in T.Parallel(K, V):
                ds[i, j] = ds[i, j] * chunk_decay
            # dOg = scale D r_q dO (rows past the end zero), in dU's buffer once dU of the chunk before is read
            T.barrier_wait(sh.do_full[0], c % 2)
            if c > 0:
                T.barrier_wait(sh.du_free[0], (c - 1) % 2)
            for t, d in T.Parallel(_C, V):
                sh.du[t, d] = T.if_then_else(
                    t < cta.eos - cta.start_of(c),
                    T.cast(times_rstd(cta.scale * sh.dec[t], rq(sh), t) * T.cast(sh.do[t, d], f32), op), T.cast(0, op))
            T.fence_proxy_async()
            T.barrier_arrive(sh.do_free[0])
            stamp(cta, "state", c, "dog_made")
            T.gemm(sh.q, sh.du, ds, transpose_A=True)
            stamp(cta, "state", c, "q_dog")
            T.barrier_arrive(sh.dog_free[0])
            if c > 0:
                chunk_epilogue(sh, cta, c - 1, c - 1 >= cta.n_warm, lane, col, decay_before, dg, dbeta)
            T.barrier_wait(sh.vs_full[0], c % 2)
            if c >= cta.n_warm:
                state_dot(sh, lane)
            T.barrier_wait(sh.du_ready[0], c % 2)
            stamp(cta, "state", c, "du_ready")
            T.gemm(sh.k, sh.du, ds, transpose_A=True)
            stamp(cta, "state", c, "k_du")
            T.barrier_arrive(sh.du_free[0])
            T.barrier_arrive(sh.qk_free[0])
        if cta.n_chunks > cta.n_warm:  # the last chunk is the piece's
            column_sums(sh, cta, cta.n_chunks - 1, True, lane, col)
            chunk_epilogue(sh, cta, cta.n_chunks - 1, True, lane, col, chunk_decay, dg, dbeta)
        if cta.walk_first == cta.bos:
            T.copy(ds, dh0[cta.seq, cta.head, 0:K, 0:V])

    @T.macro
    def store_rows(sh, cta, frag, out, start, length, first, width, in_flight=0, stage=None):
        """out[start + t, head, first + d] = frag[t, d] for the chunk's rows t < length. A full chunk goes through
        the columns first .. first + width of `stage` (default sh.delta, the delta role's own between its last read
        of Delta and the next chunk's) and one TMA store: the threads' stores of a wgmma fragment write 4 bytes
        each (~2.4k cycles for a 64 x 128 tile, docs/kernel-notes.md). A sequence's partial last chunk is stored by
        the threads: a 64-row box would write into the next sequence's rows. in_flight: how many of the role's
        last stores may still be in flight (those reading other bytes)."""
        stage = sh.delta if stage is None else stage
        if length == _C:
            T.tma_store_wait(in_flight)  # the role's earlier stores have read these bytes (the issuer waits, then all)
            T.sync_threads(_DELTA_BARRIER, WARPGROUP)
            T.copy(frag, stage[0:_C, first:first + width])
            T.fence_proxy_async()
            T.tma_copy(stage[0:_C, first:first + width], out[start:start + _C, cta.head, first:first + width])
        else:
            for t, d in T.Parallel(_C, width):
                if t < length:
                    out[start + t, cta.head, first + d] = T.cast(frag[t, d], op)

    @T.macro
    def dq_half_product(sh, cta, dq, rows_half, dq_rows, first):
        """Columns first .. first + K / 2 of r_q dq into dq: dO through S0's matching rows, scaled, its row products
        with q's half summed into dq_rows (dgamma's dq term; the half at 0 clears it), then Z K's half."""
        half = K // 2
        T.gemm(sh.do, sh.s0[first:first + half, 0:V], dq, transpose_B=True, clear_accum=True)
        for t, d in T.Parallel(_C, half):
            dq[t, d] = dq[t, d] * times_rstd(cta.scale * sh.dec[t], rq(sh), t)
        for t, d in T.Parallel(_C, half):
            rows_half[t, d] = dq[t, d] * T.cast(sh.q[t, first + d], f32)
        T.reduce_sum(rows_half, dq_rows, dim=1, clear=first == 0)
        T.gemm(sh.cols, sh.k[0:_C, first:first + half], dq)

    @T.macro
    def dq_half(sh, cta, start, length, dq_head, dq, rows_half, dq_rows, first):
        """Columns first .. first + K / 2 of dq (of q^ with the norm), stored."""
        half = K // 2
        dq_half_product(sh, cta, dq, rows_half, dq_rows, first)
        if normalize_qk:
            for t, d in T.Parallel(_C, half):
                dq[t, d] = dq[t, d] / sh.q_rstd[t]
        store_rows(sh, cta, dq, dq_head, start, length, first, half, in_flight=int(first > 0))

    @T.macro
    def minus_norm_projection(y, x, rstd, dots, first, width):
        """y -= r^2 x (x . y) on columns first .. first + width of x: the L2 norm's backward of y = r dx^ (x . y,
        the whole rows' dots, in dots)."""
        for t, d in T.Parallel(_C, width):
            y[t, d] = y[t, d] - rstd[t] * rstd[t] * dots[t] * T.cast(x[t, first + d], f32)

    @T.macro
    def dq_through_the_norm(sh, cta, start, length, dq_head, dq, rows_half, dq_rows, q_dots):
        """dq of q (l2norm_backward), stored: with y = r dq^ (what dq_half_product makes), r (dq^ - q^ (q^ . dq^))
        = y - r^2 q (q . y), whose row dot needs both halves; the first waits in Delta's buffer (bf16, as the
        norm's own kernel would read it) until the second is made."""
        half = K // 2
        dq_half_product(sh, cta, dq, rows_half, dq_rows, 0)
        for t, d in T.Parallel(_C, half):
            rows_half[t, d] = dq[t, d] * T.cast(sh.q[t, d], f32)
        T.reduce_sum(rows_half, q_dots, dim=1, clear=True)
        T.tma_store_wait(0)  # the chunk before's last store has read Delta's buffer
        T.sync_threads(_DELTA_BARRIER, WARPGROUP)
        T.copy(dq, sh.delta[0:_C, 0:half])
        dq_half_product(sh, cta, dq, rows_half, dq_rows, half)
        for t, d in T.Parallel(_C, half):
            rows_half[t, d] = dq[t, d] * T.cast(sh.q[t, half + d], f32)
        T.reduce_sum(rows_half, q_dots, dim=1, clear=False)
        minus_norm_projection(dq, sh.q, sh.q_rstd, q_dots, half, half)
        store_rows(sh, cta, dq, dq_head, start, length, half, half)
        T.sync_threads(_DELTA_BARRIER, WARPGROUP)  # the first half read back by other lanes than wrote it
        T.copy(sh.delta[0:_C, 0:half], dq)
        minus_norm_projection(dq, sh.q, sh.q_rstd, q_dots, 0, half)
        store_rows(sh, cta, dq, dq_head, start, length, 0, half, in_flight=1)

    @T.macro
    def delta_chunk(sh, cta, c, own, dv, dk_head, dq_head, acc, pm_do, dk, rows, row_sum, te, rk_rows, dq,
                    rows_half, dq_rows, q_dots):
        """Chunk c of the delta role; own (a Python bool): a chunk of the piece, else a warm-up chunk (the
        chain only). Two loops instead of a run-time branch: ptxas then sees no fragment live across chunks."""
        lane = T.get_thread_binding() - WARPGROUP
        if True:
            start = cta.start_of(c)
            length = T.min(cta.eos - start, _C)
            stamp(cta, "delta", c, "top")
            T.barrier_wait(sh.qk_full[0], c % 2)
            T.barrier_wait(sh.vs_full[0], c % 2)
            stamp(cta, "delta", c, "tiles")
            if own:  # U = K S0, W = V - D U in v's buffer while the products role makes Ab; Delta = Ab W
                T.gemm(sh.k, sh.s0, acc, clear_accum=True)
                # read whole, then written: an element-wise update in place gets a barrier per element
                for t, d in T.Parallel(_C, V):
                    acc[t, d] = T.cast(sh.w[t, d], f32) - times_rstd(sh.dec[t], rk(sh), t) * acc[t, d]
                T.copy(acc, sh.w)
                T.fence_proxy_async()
            T.barrier_wait(sh.prod_ready[0], c % 2)
            stamp(cta, "delta", c, "products")
            if own:
                T.gemm(sh.ab, sh.w, acc, clear_accum=True)
                stamp(cta, "delta", c, "delta")
            if c > 0:
                T.barrier_wait(sh.delta_free[0], (c - 1) % 2)
            if own:
                T.tma_store_wait(0)  # the chunk before's last store has read sh.delta
                T.sync_threads(_DELTA_BARRIER, WARPGROUP)
                T.copy(acc, sh.delta)
                T.fence_proxy_async()
            T.barrier_arrive(sh.delta_ready[0])
            stamp(cta, "delta", c, "delta_handed")
            # dDelta = E K dS1 + Pm^T dO: the second term before dS1 arrives
            T.barrier_wait(sh.do_full[0], c % 2)
            T.gemm(sh.pm, sh.do, pm_do, transpose_A=True, clear_accum=True)
            stamp(cta, "delta", c, "pm_do")
            T.barrier_wait(sh.ds_ready[0], c % 2)
            stamp(cta, "delta", c, "ds_ready")
            T.gemm(sh.k, sh.ds, acc, clear_accum=True)
            for t, d in T.Parallel(_C, V):
                acc[t, d] = acc[t, d] * times_rstd(sh.rdec[t], rk(sh), t) + pm_do[t, d]
            if c > 0:
                T.barrier_wait(sh.dd_free[0], (c - 1) % 2)
            for t, d in T.Parallel(_C, V):
                sh.dd[t, d] = T.if_then_else(t < length, T.cast(acc[t, d], op), T.cast(0, op))
            T.fence_proxy_async()
            T.barrier_arrive(sh.dd_ready[0])
            stamp(cta, "delta", c, "dd_handed")
            # dW = Ab^T dDelta = dv;  dU = -D r_k dW, for the state and dk
            T.gemm(sh.ab, sh.dd, acc, transpose_A=True, clear_accum=True)
            T.barrier_arrive(sh.prod_free[0])
            stamp(cta, "delta", c, "dw")
            T.barrier_wait(sh.dog_free[0], c % 2)
            for t, d in T.Parallel(_C, V):
                sh.du[t, d] = T.cast(-times_rstd(sh.dec[t], rk(sh), t) * acc[t, d], op)
            T.fence_proxy_async()
            T.barrier_arrive(sh.du_ready[0])
            stamp(cta, "delta", c, "du_handed")
            if own:  # stored once dU, on the state's chain, is handed over, through dDelta's buffer once the
                # products role's dAb has read it too (Delta's is still read below)
                T.barrier_wait(sh.dab_done[0], c % 2)
                store_rows(sh, cta, acc, dv, start, length, 0, V, stage=sh.dd)
            # dk's state terms and dgamma's D and E terms (module docstring)
            if own:
                T.gemm(sh.delta, sh.ds, dk, transpose_B=True, clear_accum=True)
                T.tma_store_wait(0)  # dv's store has read dDelta's buffer, where the products role's tile goes next
            T.barrier_arrive(sh.dd_read[0])
            T.barrier_arrive(sh.ds_free[0])
            if own:
                for t, d in T.Parallel(_C, K):
                    rows[t, d] = dk[t, d] * T.cast(sh.k[t, d], f32)
                T.reduce_sum(rows, row_sum, dim=1, clear=True)
                for t in T.Parallel(_C):
                    te[t] = times_rstd(sh.rdec[t], rk(sh), t) * row_sum[t]
                for t, d in T.Parallel(_C, K):
                    dk[t, d] = dk[t, d] * times_rstd(sh.rdec[t], rk(sh), t)
                T.gemm(sh.du, sh.s0, dk, transpose_B=True)
            T.barrier_arrive(sh.du_free[0])
            stamp(cta, "delta", c, "dk_state")
            if own:
                for t, d in T.Parallel(_C, K):
                    rows[t, d] = dk[t, d] * T.cast(sh.k[t, d], f32)
                T.reduce_sum(rows, row_sum, dim=1, clear=True)
            if c > 0:
                T.barrier_wait(sh.vg_free[0], (c - 1) % 2)
            if own:
                for t in T.Parallel(_C):
                    sh.te[t] = te[t]
                    te[t] = row_sum[t] - 2.0 * te[t]  # dgamma's D and E terms, handed over with dq's below
            stamp(cta, "delta", c, "vg_stored")
            T.barrier_wait(sh.dpm_ready[0], c % 2)
            stamp(cta, "delta", c, "dpm_ready")
            # dq = scale D dO S0^T + dPm K^ as r_q dq = r_q scale D dO S0^T + Z K (module docstring), in two halves
            # of its columns beside dk; dgamma gains rowsum(the first term . Q^)
            if own:
                if l2norm_backward:
                    dq_through_the_norm(sh, cta, start, length, dq_head, dq, rows_half, dq_rows, q_dots)
                else:
                    dq_half(sh, cta, start, length, dq_head, dq, rows_half, dq_rows, 0)
                    dq_half(sh, cta, start, length, dq_head, dq, rows_half, dq_rows, K // 2)
            T.barrier_arrive(sh.do_free[0])
            T.barrier_arrive(sh.vs_free[0])
            stamp(cta, "delta", c, "dq")
            if own:
                for t in T.Parallel(_C):
                    sh.dgam_v[t] = te[t] + dq_rows[t]
            T.barrier_arrive(sh.vg_ready[0])
            stamp(cta, "delta", c, "vg_handed")
            # dk += dPm^T Q^ + X K^ + X^T K^, as r_k dk: Z^T Q + Y K + Y^T K (module docstring)
            if own:
                T.gemm(sh.cols, sh.q, dk, transpose_A=True)
            T.barrier_arrive(sh.dpm_read[0])
            stamp(cta, "delta", c, "zq")
            T.barrier_wait(sh.x_ready[0], c % 2)
            stamp(cta, "delta", c, "x_ready")
            if own:
                if normalize_qk and not l2norm_backward:  # r_k kept past the release of the chunk's q, k below
                    for t in T.Parallel(_C):
                        rk_rows[t] = sh.k_rstd[t]
                T.gemm(sh.cols, sh.k, dk)
                T.gemm(sh.cols, sh.k, dk, transpose_A=True)
            T.barrier_arrive(sh.x_free[0])
            if own:
                if l2norm_backward:  # as dq's (dq_through_the_norm), while k is still in: y - r^2 k (k . y)
                    for t, d in T.Parallel(_C, K):
                        rows[t, d] = dk[t, d] * T.cast(sh.k[t, d], f32)
                    T.reduce_sum(rows, row_sum, dim=1, clear=True)
                    minus_norm_projection(dk, sh.k, sh.k_rstd, row_sum, 0, K)
            T.barrier_arrive(sh.qk_free[0])
            stamp(cta, "delta", c, "qk_released")
            if own:
                if normalize_qk and not l2norm_backward:
                    for t, d in T.Parallel(_C, K):
                        dk[t, d] = dk[t, d] / rk_rows[t]
                store_rows(sh, cta, dk, dk_head, start, length, 0, K)
            stamp(cta, "delta", c, "dk_stored")

    @T.macro
    def delta_role(sh, cta, dv, dk_head, dq_head):
        T.set_max_nreg(registers[1], 1)
        acc = T.alloc_fragment((_C, V), f32)
        pm_do = T.alloc_fragment((_C, V), f32)
        dk = T.alloc_fragment((_C, K), f32)
        rows = T.alloc_fragment((_C, K), f32)
        row_sum = T.alloc_fragment((_C,), f32)
        te = T.alloc_fragment((_C,), f32)
        rk_rows = T.alloc_fragment((_C,), f32) if normalize_qk else None
        q_dots = T.alloc_fragment((_C,), f32) if l2norm_backward else None
        dq = T.alloc_fragment((_C, K // 2), f32)
        rows_half = T.alloc_fragment((_C, K // 2), f32)
        dq_rows = T.alloc_fragment((_C,), f32)
        args = (dv, dk_head, dq_head, acc, pm_do, dk, rows, row_sum, te, rk_rows, dq, rows_half, dq_rows, q_dots)
        for c in T.serial(cta.n_warm):
            delta_chunk(sh, cta, c, False, *args)
        for c in T.serial(cta.n_chunks - cta.n_warm):
            delta_chunk(sh, cta, cta.n_warm + c, True, *args)
        T.tma_store_wait(0, read=False)  # the last stores are done before the CTA's shared memory goes

    @T.macro
    def products_chunk(sh, cta, c, own, pmf, gm, dp, dab, row_sum, row_sum_cc):
        """Chunk c of the products role; own as in delta_chunk. The column sums and dg's suffix sums are the state
        role's (column_sums, chunk_epilogue): this role hands over two float32 tiles and two row-sum arrays."""
        if True:
            start = cta.start_of(c)
            length = T.min(cta.eos - start, _C)
            stamp(cta, "products", c, "top")
            T.barrier_wait(sh.qk_full[0], c % 2)
            T.barrier_wait(sh.a_full[0], c % 2)
            stamp(cta, "products", c, "tiles")
            # Pm = scale Gm . Q^ K^^T and Ab = (Gm . A~) diag(beta), for the chain
            T.gemm(sh.q, sh.k, pmf, transpose_B=True, clear_accum=True)
            for t, s in T.Parallel(_C, _C):
                gm[t, s] = T.if_then_else((s <= t) & (t < length), T.exp(sh.gam[t] - sh.gam[s]), 0.0)
            for t, s in T.Parallel(_C, _C):
                pmf[t, s] = times_rstd(times_rstd(cta.scale * pmf[t, s] * gm[t, s], rq(sh), t), rk(sh), s)
            if c > 0:
                T.barrier_wait(sh.prod_free[0], (c - 1) % 2)
            for t, s in T.Parallel(_C, _C):
                sh.pm[t, s] = T.cast(pmf[t, s], op)
            for t, s in T.Parallel(_C, _C):
                sh.ab[t, s] = T.cast(T.cast(sh.a[t, s], f32) * gm[t, s] * sh.beta[s], op)
            T.fence_proxy_async()
            T.barrier_arrive(sh.prod_ready[0])
            stamp(cta, "products", c, "products")
            T.barrier_wait(sh.do_full[0], c % 2)
            T.barrier_wait(sh.vs_full[0], c % 2)
            # dP = dO Delta^T, then Z for dq and dk
            T.barrier_wait(sh.delta_ready[0], c % 2)
            stamp(cta, "products", c, "delta_ready")
            if own:
                T.gemm(sh.do, sh.delta, dp, transpose_B=True, clear_accum=True)
            T.barrier_arrive(sh.delta_free[0])
            T.barrier_arrive(sh.do_free[0])
            stamp(cta, "products", c, "dp")
            if c > 0:
                T.barrier_wait(sh.x_free[0], (c - 1) % 2)
            if own:  # Z = diag(r_q) dPm diag(r_k), dPm = scale Gm . dP
                for t, s in T.Parallel(_C, _C):
                    sh.cols[t, s] = T.cast(times_rstd(times_rstd(cta.scale * dp[t, s] * gm[t, s], rq(sh), t), rk(sh), s),
                                           op)
                T.fence_proxy_async()
            T.barrier_arrive(sh.dpm_ready[0])
            stamp(cta, "products", c, "z_handed")
            if own:  # dP's part of dGm . Gm (the rest below): pmf is read for the last time
                for t, s in T.Parallel(_C, _C):
                    dp[t, s] = dp[t, s] * pmf[t, s]
            # dAb = dDelta W^T: this role's last read of W, whose bytes then hold the dgamma tile
            T.barrier_wait(sh.dd_ready[0], c % 2)
            stamp(cta, "products", c, "dd_ready")
            if own:
                T.gemm(sh.dd, sh.w, dab, transpose_B=True, clear_accum=True)
                stamp(cta, "products", c, "dab")
            T.barrier_arrive(sh.dab_done[0])
            T.barrier_wait(sh.dd_read[0], c % 2)
            stamp(cta, "products", c, "dd_read")
            if own:
                # dbeta's tile dAb . Ag (Ag = Gm . A~), in dDelta's bytes
                for t, s in T.Parallel(_C, _C):
                    sh.cc_beta[t, s] = dab[t, s] * gm[t, s] * T.cast(sh.a[t, s], f32)
                # dA~ = Gm . dAb diag(beta), in Pm's buffer (the delta role's last read of Pm came before dDelta)
                for t, s in T.Parallel(_C, _C):
                    sh.pm[t, s] = T.cast(dab[t, s] * sh.beta[s] * gm[t, s], op)
                T.fence_proxy_async()
                # dGm . Gm = dAg . Ag + scale dP . Gm . Q^K^T: dgamma gains its row sums and loses its column sums
                # (dgamma's tile, in W's bytes)
                for t, s in T.Parallel(_C, _C):
                    dp[t, s] = dp[t, s] + dab[t, s] * sh.beta[s] * gm[t, s] * T.cast(sh.a[t, s], f32)
                T.reduce_sum(dp, row_sum_cc, dim=1, clear=True)
                for t, s in T.Parallel(_C, _C):
                    sh.cc_gam[t, s] = dp[t, s]
                T.fence_proxy_async()  # the next chunk's v lands in W's bytes by TMA
            T.barrier_arrive(sh.cc_ready[0])
            T.barrier_arrive(sh.vs_free[0])
            stamp(cta, "products", c, "cc_handed")
            if c > 0:
                T.barrier_wait(sh.rows_free[0], (c - 1) % 2)
            if own:
                for t in T.Parallel(_C):
                    sh.dgam_rows[t] = row_sum_cc[t]
                # T1 = A~^T dA~ (into dA~'s buffer), dL = -strict lower(T1 A~^T), and K K^T for dbeta
                T.gemm(sh.a, sh.pm, dp, transpose_A=True, clear_accum=True)
                for t, s in T.Parallel(_C, _C):
                    sh.pm[t, s] = T.cast(dp[t, s], op)
                T.fence_proxy_async()
                T.gemm(sh.pm, sh.a, dab, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(_C, _C):
                    dab[t, s] = T.if_then_else(s < t, -dab[t, s], 0.0)
                T.gemm(sh.k, sh.k, dp, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(_C, _C):
                    dp[t, s] = times_rstd(times_rstd(dab[t, s] * dp[t, s], rk(sh), t), rk(sh), s)
                T.reduce_sum(dp, row_sum, dim=1, clear=True)
                for t in T.Parallel(_C):
                    sh.dbeta_rows[t] = row_sum[t]
            T.barrier_arrive(sh.a_free[0])
            stamp(cta, "products", c, "t1_dl")
            # Y = diag(r_k) X diag(r_k), X = diag(beta) dL, into Z's tile once the delta role has read it
            T.barrier_wait(sh.dpm_read[0], c % 2)
            stamp(cta, "products", c, "dpm_read")
            if own:
                for t, s in T.Parallel(_C, _C):
                    sh.cols[t, s] = T.cast(times_rstd(times_rstd(dab[t, s] * sh.beta[t], rk(sh), t), rk(sh), s), op)
                T.fence_proxy_async()
            T.barrier_arrive(sh.x_ready[0])
            T.barrier_arrive(sh.qk_free[0])
            T.barrier_arrive(sh.rows_ready[0])
            stamp(cta, "products", c, "y_handed")

    @T.macro
    def products_role(sh, cta):
        T.set_max_nreg(registers[2], 1)
        pmf = T.alloc_fragment((_C, _C), f32)   # scale Gm . Q^K^T, in float32
        gm = T.alloc_fragment((_C, _C), f32)
        dp = T.alloc_fragment((_C, _C), f32)
        dab = T.alloc_fragment((_C, _C), f32)
        row_sum = T.alloc_fragment((_C,), f32)
        row_sum_cc = T.alloc_fragment((_C,), f32)
        args = (pmf, gm, dp, dab, row_sum, row_sum_cc)
        for c in T.serial(cta.n_warm):
            products_chunk(sh, cta, c, False, *args)
        for c in T.serial(cta.n_chunks - cta.n_warm):
            products_chunk(sh, cta, cta.n_warm + c, True, *args)

    @T.macro
    def load_qk(sh, cta, q, k, gamma, beta, q_rstd, k_rstd):
        lane = T.get_thread_binding() % 32
        if normalize_qk:  # held in a variable: inlined into the r loads' indices it is a 64-bit division
            qk_head = T.alloc_var("int32")
            qk_head = cta.qk_head
        gam = T.alloc_local((2,), f32)
        bet = T.alloc_local((2,), f32)
        rq_t = T.alloc_local((2,), f32)
        rk_t = T.alloc_local((2,), f32)
        gam_last = T.alloc_var(f32)
        for c in T.serial(cta.n_chunks):
            start = cta.start_of(c)
            last = T.min(cta.eos - start, _C) - 1
            # the scalars are read before the wait, so their latency hides behind the chunk before;
            # gamma clamped past the end (e^{gamma_C} is the decay over the real tokens); beta and E zero there
            for h in T.unroll(2):
                t = lane + 32 * h
                gam[h] = gamma[start + T.min(t, last), cta.head]
                bet[h] = T.if_then_else(t <= last, beta[start + T.min(t, last), cta.head], 0.0)
                if normalize_qk:
                    rq_t[h] = q_rstd[T.min(start + t, num_tokens - 1), qk_head]
                    rk_t[h] = k_rstd[T.min(start + t, num_tokens - 1), qk_head]
            gam_last = gamma[start + last, cta.head]
            if c > 0:
                T.barrier_wait(sh.qk_free[0], (c - 1) % 2)
                stamp(cta, "loads", c, "qk_free")
            T.tma_copy(q[start:start + _C, cta.qk_head, 0:K], sh.q, barrier=sh.qk_full[0])
            T.tma_copy(k[start:start + _C, cta.qk_head, 0:K], sh.k, barrier=sh.qk_full[0])
            for h in T.unroll(2):
                t = lane + 32 * h
                sh.gam[t] = gam[h]
                sh.beta[t] = bet[h]
                sh.dec[t] = T.exp(gam[h])
                sh.rdec[t] = T.if_then_else(t <= last, T.exp(gam_last - gam[h]), 0.0)
                if normalize_qk:
                    sh.q_rstd[t] = rq_t[h]
                    sh.k_rstd[t] = rk_t[h]
            T.barrier_arrive(sh.qk_full[0])
            stamp(cta, "loads", c, "issued")

    @T.macro
    def load_inverse(sh, cta, inverse):
        for c in T.serial(cta.n_chunks):
            start = cta.start_of(c)
            if c > 0:
                T.barrier_wait(sh.a_free[0], (c - 1) % 2)
            T.tma_copy(inverse[start:start + _C, cta.head, 0:_C], sh.a, barrier=sh.a_full[0])
            T.barrier_arrive(sh.a_full[0])

    @T.macro
    def load_v_state(sh, cta, v, chunk_states):
        for c in T.serial(cta.n_chunks):
            start = cta.start_of(c)
            if c > 0:
                T.barrier_wait(sh.vs_free[0], (c - 1) % 2)
            if start < cta.piece_end:  # warm-up chunks read neither
                T.tma_copy(v[start:start + _C, cta.head, 0:V], sh.w, barrier=sh.vs_full[0])
                T.tma_copy(chunk_states[cta.first_chunk + (start - cta.bos) // _C, cta.head, 0:K, 0:V], sh.s0,
                           barrier=sh.vs_full[0])
            T.barrier_arrive(sh.vs_full[0])

    @T.macro
    def load_do(sh, cta, do):
        for c in T.serial(cta.n_chunks):
            start = cta.start_of(c)
            if c > 0:
                T.barrier_wait(sh.do_free[0], (c - 1) % 2)
            T.tma_copy(do[start:start + _C, cta.head, 0:V], sh.do, barrier=sh.do_full[0])
            T.barrier_arrive(sh.do_full[0])

    @T.prim_func
    def fused_backward_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), op),
        k: T.Tensor((num_tokens, num_qk_heads, K), op),
        v: T.Tensor((num_tokens, num_v_heads, V), op),
        gamma: T.Tensor((num_tokens, num_v_heads), f32),
        beta: T.Tensor((num_tokens, num_v_heads), f32),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), op),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), op),
        do: T.Tensor((num_tokens, num_v_heads, V), op),
        dht: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        cu_seqlens: T.Tensor((num_sequences + 1,), "int32"),
        chunk_offsets: T.Tensor((num_sequences + 1,), "int32"),
        piece_table: T.Tensor((num_pieces, PIECE_FIELDS), "int32"),
        walk_end: T.Tensor((num_pieces, num_v_heads), "int32"),
        q_rstd: T.Tensor((rstd_rows, num_qk_heads), f32),
        k_rstd: T.Tensor((rstd_rows, num_qk_heads), f32),
        dq_head: T.Tensor((num_tokens, num_v_heads, K), op),
        dk_head: T.Tensor((num_tokens, num_v_heads, K), op),
        dv: T.Tensor((num_tokens, num_v_heads, V), op),
        dg: T.Tensor((num_tokens, num_v_heads), f32),
        dbeta: T.Tensor((num_tokens, num_v_heads), f32),
        dh0: T.Tensor((num_sequences, num_v_heads, K, V), f32),
        timeline: T.Tensor((timeline_ctas, len(TIMELINE_EVENTS), TIMELINE_CHUNKS, _TIMELINE_SLOTS), "int64"),
        scale: T.float32,
    ):
        with T.Kernel(num_v_heads, num_pieces, threads=_THREADS) as (head, piece):
            seq = piece_table[piece, 0]
            bos = cu_seqlens[seq]
            walk_last = walk_end[piece, head]
            # chunks are aligned to the sequence start; the walk's first chunk is the one holding walk_last - 1
            top = bos + (walk_last - bos + _C - 1) // _C * _C
            walk_first = piece_table[piece, 1]
            piece_end = piece_table[piece, 2]
            cta = SimpleNamespace(
                head=head, qk_head=head // (num_v_heads // num_qk_heads), seq=seq, bos=bos, eos=cu_seqlens[seq + 1],
                walk_first=walk_first, walk_last=walk_last, piece_end=piece_end,
                n_chunks=(top - walk_first) // _C, n_warm=(top - walk_first) // _C - (piece_end - walk_first + _C - 1) // _C,
                first_chunk=chunk_offsets[seq], scale=scale, timeline=timeline, index=piece * num_v_heads + head,
                start_of=lambda c: top - (c + 1) * _C)
            w = T.alloc_shared((_C, V), op)
            dd = T.alloc_shared((_C, V), op)
            sh = SimpleNamespace(
                q=T.alloc_shared((_C, K), op),
                k=T.alloc_shared((_C, K), op),
                w=w,                                  # v by TMA, then W in place
                do=T.alloc_shared((_C, V), op),
                a=T.alloc_shared((_C, _C), op),       # A~
                s0=T.alloc_shared((K, V), op),
                ds=T.alloc_shared((K, V), op),        # dS1, from the state role
                pm=T.alloc_shared((_C, _C), op),      # Pm, then dA~, then T1
                ab=T.alloc_shared((_C, _C), op),
                delta=T.alloc_shared((_C, V), op),
                dd=dd,                                # dDelta
                # the products role's float32 tiles for the state role's column sums (column_sums), in bytes
                # whose other uses in the chunk are over by then
                cc_beta=T.view(dd, (_C, _C), f32),
                cc_gam=T.view(w, (_C, _C), f32),
                du=T.alloc_shared((_C, V), op),       # dOg, then dU
                cols=T.alloc_shared((_C, _C), op),    # Z (dPm), then Y (X), scaled by r on both sides
                gam=T.alloc_shared((_C,), f32),
                beta=T.alloc_shared((_C,), f32),
                dec=T.alloc_shared((_C,), f32),       # e^{gamma_t}
                rdec=T.alloc_shared((_C,), f32),      # e^{gamma_C - gamma_t}, zero past the end
                q_rstd=T.alloc_shared((_C,), f32) if normalize_qk else None,
                k_rstd=T.alloc_shared((_C,), f32) if normalize_qk else None,
                dgam_rows=T.alloc_shared((_C,), f32),  # the products role's row sums for dgamma
                dgam_v=T.alloc_shared((_C,), f32),
                te=T.alloc_shared((_C,), f32),
                dbeta_rows=T.alloc_shared((_C,), f32),
                dot_part=T.alloc_shared((4,), f32),   # <S0, dS1> per warp of the state role
                suffix_part=T.alloc_shared((2,), f32),
                te_part=T.alloc_shared((2,), f32),
                qk_full=T.alloc_barrier(arrive_count=[32]),
                qk_free=T.alloc_barrier(arrive_count=[3 * WARPGROUP]),
                a_full=T.alloc_barrier(arrive_count=[32]),
                a_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                vs_full=T.alloc_barrier(arrive_count=[32]),
                vs_free=T.alloc_barrier(arrive_count=[3 * WARPGROUP]),
                do_full=T.alloc_barrier(arrive_count=[32]),
                do_free=T.alloc_barrier(arrive_count=[3 * WARPGROUP]),
                ds_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                ds_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                prod_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                prod_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dog_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                du_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                du_free=T.alloc_barrier(arrive_count=[2 * WARPGROUP]),
                delta_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                delta_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dd_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dd_read=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dab_done=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dd_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dpm_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                dpm_read=T.alloc_barrier(arrive_count=[WARPGROUP]),
                x_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                x_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                vg_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                vg_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                cc_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                rows_ready=T.alloc_barrier(arrive_count=[WARPGROUP]),
                rows_free=T.alloc_barrier(arrive_count=[WARPGROUP]),
                state_sync=T.alloc_barrier(arrive_count=[WARPGROUP]),
            )
            tx = T.get_thread_binding()
            if tx < WARPGROUP:
                state_role(sh, cta, dht, dh0, dg, dbeta)
            elif tx < 2 * WARPGROUP:
                delta_role(sh, cta, dv, dk_head, dq_head)
            elif tx < 3 * WARPGROUP:
                products_role(sh, cta)
            else:
                T.set_max_nreg(registers[3], 0)
                if tx < 3 * WARPGROUP + 32:
                    load_qk(sh, cta, q, k, gamma, beta, q_rstd, k_rstd)
                elif tx < 3 * WARPGROUP + 64:
                    load_inverse(sh, cta, inverse)
                elif tx < 3 * WARPGROUP + 96:
                    load_v_state(sh, cta, v, chunk_states)
                else:
                    load_do(sh, cta, do)

    return fused_backward_kernel


@functools.lru_cache(maxsize=None)
def compile_fused_backward(normalize_qk: bool = False, record_timeline: bool = False, l2norm_backward: bool = False,
                           registers: tuple[int, int, int, int] = _REGISTERS):
    return compile_for_hopper(fused_backward_program(normalize_qk, record_timeline, l2norm_backward, tuple(registers)),
                              fast_math=True)


def fused_backward_grads(q, k, v, gamma, beta, inverse, chunk_states, do, dht, scale, cu_seqlens, offsets, pieces,
                         walk_end, rstds: tuple | None = None, timeline: torch.Tensor | None = None,
                         l2norm_backward: bool = False, registers: tuple[int, int, int, int] | None = None):
    """(dq, dk per value head, dv, dg, dbeta, dh0) on flattened bf16 inputs.

    q, k: [T, Hqk, 128]; v, do: [T, Hv, 128]; gamma (chunk-local cumsum), beta: float32 [T, Hv]; inverse (A~):
    [T, Hv, 64]; chunk_states: [num_chunks, Hv, 128, 128] entering every chunk; dht: float32 [N, Hv, 128, 128];
    cu_seqlens, offsets: int32 [N + 1]; pieces: any piece plan's rows (the forward plan's, backward.py); walk_end: their
    walk_bounds(ahead=True). rstds: (q_rstd, k_rstd) float32 [T, Hqk] when q, k are the L2 norm's inputs: dq, dk
    are then those of q^, k^ (the norm's backward is the caller's), or with l2norm_backward (Hv = Hqk only) those
    of q, k. timeline: int64 [P * Hv, 4, TIMELINE_CHUNKS, slots] (timeline_shape) to fill with the clock at each
    role's TIMELINE_EVENTS; the outputs are unchanged. registers (None: the walk's): fused_backward_program's.
    dq, dk, dv bf16 [T, Hv, 128]; dg, dbeta float32 [T, Hv]; dh0 float32 [N, Hv, 128, 128].
    """
    num_tokens = q.shape[0]
    num_v_heads = v.shape[1]
    if l2norm_backward and (rstds is None or num_v_heads != q.shape[1]):
        raise ValueError(f"fused_backward_grads: l2norm_backward needs rstds and as many q, k heads as value heads, "
                         f"got rstds {'None' if rstds is None else 'given'}, {q.shape[1]} q, k heads, "
                         f"{num_v_heads} value heads")
    bf16 = dict(dtype=torch.bfloat16, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.empty(num_tokens, num_v_heads, HEAD_DIM, **bf16)
    dk = torch.empty(num_tokens, num_v_heads, HEAD_DIM, **bf16)
    dv = torch.empty(num_tokens, num_v_heads, HEAD_DIM, **bf16)
    dg = torch.empty(num_tokens, num_v_heads, **f32)
    dbeta = torch.empty(num_tokens, num_v_heads, **f32)
    dh0 = torch.empty(cu_seqlens.numel() - 1, num_v_heads, HEAD_DIM, HEAD_DIM, **f32)
    kernel = compile_fused_backward(rstds is not None, timeline is not None, l2norm_backward,
                                    _REGISTERS if registers is None else tuple(registers))
    if rstds is None:
        rstds = (torch.empty(1, q.shape[1], **f32),) * 2
    if timeline is None:
        timeline = torch.empty(1, len(TIMELINE_EVENTS), TIMELINE_CHUNKS, _TIMELINE_SLOTS, dtype=torch.int64,
                               device=q.device)
    elif tuple(timeline.shape) != timeline_shape(pieces.shape[0], num_v_heads):
        raise ValueError(f"fused_backward_grads: timeline must be int64 {list(timeline_shape(pieces.shape[0], num_v_heads))}"
                         f", got {list(timeline.shape)}")
    kernel(q, k, v, gamma, beta, inverse, chunk_states, do, dht, cu_seqlens, offsets, pieces, walk_end, *rstds,
           dq, dk, dv, dg, dbeta, dh0, timeline, float(scale))
    return dq, dk, dv, dg, dbeta, dh0


def timeline_shape(num_pieces: int, num_v_heads: int) -> tuple[int, int, int, int]:
    """fused_backward_grads' timeline: (CTA = piece * Hv + head, role in TIMELINE_EVENTS' order, chunk, event)."""
    return (num_pieces * num_v_heads, len(TIMELINE_EVENTS), TIMELINE_CHUNKS, _TIMELINE_SLOTS)
