"""Candidate: the chunk-gradient kernel with its two warpgroups on two chains of products.

The same inputs, outputs and math as backward_chunk_grads.py (docs/gdn-math.md §3.2-3.3); the plan
is docs/kernel-notes.md, "Next: the chunk gradients on two chains". There both warpgroups run every
product of a task in lockstep, each on half of N. Here each runs whole products of its own chain,
so one can use the tensor cores while the other does elementwise work:

- chain A (warpgroup 0): QK^T -> Pm, Ab; U = K S0 -> W; K dS1; Delta = Ab W; dDelta += Pm^T dO;
  dW = Ab^T dDelta -> dv, dU; dAb = dDelta W^T -> dbeta, dA~; T1 = A~^T dA~, dL = T1 A~^T, KK^T
  -> dbeta, X = diag(beta) dL;
- chain B (warpgroup 1): sum(S0 . dS1); dQ = scale D dO S0^T; dK = E Delta dS1^T + dU S0^T; its own
  QK^T and dP = dO Delta^T -> dPm; dQ += dPm K; dK += dPm^T Q + X K + X^T K.

B takes Delta, dU and X from A through shared memory, each behind an mbarrier A arrives on
(delta_ready, du_ready, x_ready). dgamma's sums split by chain and meet in shared memory; dbeta is
A's. Buffers no chain reads any more are reused: dPm goes into Ab's tile (A's last read of Ab comes
before du_ready), X into Pm's (A's own), B's float32 scratch into dU's bytes, A's into dDelta's.
Loads as in the lockstep kernel: group B (v, S0, dS1) of the next task is issued once both chains
have read it for the last time (b_free), group A after the task.

Not yet run on a GPU: reached only through `python -m flashqla.bench --compare chunk_grads` and
tests/flashqla/test_hopper_chunk_grads_two_chains.py, which pass it to
`backward_chunk_grads.chunk_gradients(..., kernel=compile_chunk_grads_two_chains())`.
"""

import functools
from types import SimpleNamespace

import tilelang.language as T

from flashqla.hopper.backward_chunk_grads import tile_sum_macros
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, compile_for_hopper

_C = CHUNK_SIZE
_WARPGROUP = 128
_THREADS = 2 * _WARPGROUP
_PARTS = _WARPGROUP // _C  # row blocks of a column sum inside one warpgroup
# Named barriers of one warpgroup each (TileLang numbers its own from the low ids).
_SYNC_A, _SYNC_B = 14, 15
TMA_BUFFERS = ("q_s", "k_s", "inv_s", "do_s", "w_s", "s0_s", "ds_s")


def two_chain_program():
    """Kernel for K = V = 128, bf16 operands, float32 gamma and beta (the lockstep kernel's arguments)."""
    K = V = HEAD_DIM
    BV = V
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    op = "bfloat16"
    f32 = "float32"

    column_partials, sum_partials = tile_sum_macros(_PARTS)

    @T.macro
    def gate(gam_s, t, s, length):
        """Gm[t, s] = e^{gamma_t - gamma_s} on and below the diagonal inside the chunk, else 0."""
        return T.if_then_else((s <= t) & (t < length), T.exp(gam_s[t] - gam_s[s]), 0.0)

    @T.macro
    def chain_a(sh, g, i, lane, length, start, head, has_next, next_chunk, next_head, next_start, next_length):
        """Warpgroup 0 (lane = tx): the products behind dv, dbeta, dA~ and X."""
        qk = T.alloc_fragment((_C, _C), f32)
        u = T.alloc_fragment((_C, BV), f32)
        d_delta = T.alloc_fragment((_C, BV), f32)
        delta = T.alloc_fragment((_C, BV), f32)
        dw = T.alloc_fragment((_C, BV), f32)
        cv = T.alloc_fragment((_C, BV), f32)
        dab = T.alloc_fragment((_C, _C), f32)
        t1 = T.alloc_fragment((_C, _C), f32)
        dl = T.alloc_fragment((_C, _C), f32)
        kk = T.alloc_fragment((_C, _C), f32)
        row_v = T.alloc_fragment((_C,), f32)
        # Pm = scale Gm . QK^T, Ab = (Gm . A~) diag(beta)
        T.gemm(sh.q_s, sh.k_s, qk, transpose_B=True, clear_accum=True)
        for t, s in T.Parallel(_C, _C):
            sh.pm_s[t, s] = T.cast(sh.scale * qk[t, s] * gate(sh.gam_s, t, s, length), op)
        for t, s in T.Parallel(_C, _C):
            sh.ab_s[t, s] = T.cast(T.cast(sh.inv_s[t, s], f32) * gate(sh.gam_s, t, s, length) * sh.b_s[s], op)
        # U = K S0, W = V - D U;  E K dS1 (the start of dDelta);  Delta = Ab W
        T.gemm(sh.k_s, sh.s0_s, u, clear_accum=True)
        for t, d in T.Parallel(_C, BV):
            sh.w_s[t, d] = T.cast(T.cast(sh.w_s[t, d], f32) - sh.dec_s[t] * u[t, d], op)
        T.gemm(sh.k_s, sh.ds_s, d_delta, clear_accum=True)
        for t, d in T.Parallel(_C, BV):
            d_delta[t, d] = d_delta[t, d] * sh.rdec_s[t]
        T.fence_proxy_async()
        T.sync_threads(_SYNC_A, _WARPGROUP)
        T.gemm(sh.ab_s, sh.w_s, delta, clear_accum=True)
        for t, d in T.Parallel(_C, BV):
            cv[t, d] = delta[t, d] * d_delta[t, d]
        T.reduce_sum(cv, row_v, dim=1, clear=True)
        for t in T.Parallel(_C):
            sh.te_s[t] = row_v[t]
        for t, d in T.Parallel(_C, BV):
            sh.delta_s[t, d] = T.cast(delta[t, d], op)
        T.fence_proxy_async()
        T.barrier_arrive(sh.delta_ready[0])
        # dDelta += Pm^T dO;  dW = Ab^T dDelta = dV;  dU = -D dW
        T.gemm(sh.pm_s, sh.do_s, d_delta, transpose_A=True)
        for t, d in T.Parallel(_C, BV):
            sh.d_delta_s[t, d] = T.cast(d_delta[t, d], op)
        T.fence_proxy_async()
        T.sync_threads(_SYNC_A, _WARPGROUP)
        T.gemm(sh.ab_s, sh.d_delta_s, dw, transpose_A=True, clear_accum=True)
        for t, d in T.Parallel(_C, BV):
            if t < length:
                g.dv[start + t, head, d] = T.cast(dw[t, d], op)
        for t, d in T.Parallel(_C, BV):
            dw[t, d] = -sh.dec_s[t] * dw[t, d]
        for t, d in T.Parallel(_C, BV):
            cv[t, d] = dw[t, d] * u[t, d]
        T.reduce_sum(cv, row_v, dim=1, clear=True)
        for t in T.Parallel(_C):
            sh.dgam_a_s[t] = row_v[t] - sh.te_s[t]
        for t, d in T.Parallel(_C, BV):
            sh.du_s[t, d] = T.cast(dw[t, d], op)
        T.fence_proxy_async()
        T.barrier_arrive(sh.du_ready[0])
        # dAb = dDelta W^T: W, S0 and dS1 are read for the last time (chain B's last reads are
        # behind sh.b_free too): load the next task's group B and its gamma / beta.
        T.gemm(sh.d_delta_s, sh.w_s, dab, transpose_B=True, clear_accum=True)
        T.barrier_arrive(sh.b_free[0])
        T.barrier_wait(sh.b_free[0], i % 2)
        if has_next:
            T.tma_copy(g.v[next_start:next_start + _C, next_head, 0:V], sh.w_s, barrier=sh.loads_b[0])
            T.tma_copy(g.chunk_states[next_chunk, next_head, 0:K, 0:V], sh.s0_s, barrier=sh.loads_b[0])
            T.tma_copy(g.chunk_state_grads[next_chunk, next_head, 0:K, 0:V], sh.ds_s, barrier=sh.loads_b[0])
            if T.shuffle_elect(_WARPGROUP):
                T.barrier_arrive(sh.loads_b[0])
            if lane < _C:
                sh.next_gb[0] = g.gamma[next_start + T.min(lane, next_length - 1), next_head]
                sh.next_gb[1] = T.if_then_else(lane < next_length,
                                               g.beta[next_start + T.min(lane, next_length - 1), next_head], 0.0)
        # dbeta = column sums of dAb . Ag (sh.tile_a: dDelta's bytes, read for the last time above)
        for t, s in T.Parallel(_C, _C):
            sh.tile_a[t, s] = dab[t, s] * T.cast(sh.inv_s[t, s], f32) * gate(sh.gam_s, t, s, length)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        column_partials(sh.tile_a, sh.col_a, lane)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        if lane < _C:
            sh.dbeta_s[lane] = sum_partials(sh.col_a, lane)
        # dAg = dAb diag(beta); dA~ = dAg . Gm; dgamma's Ag terms: row sums minus column sums of dAg . Ag
        for t, s in T.Parallel(_C, _C):
            dab[t, s] = dab[t, s] * sh.b_s[s]
        for t, s in T.Parallel(_C, _C):
            sh.pm_s[t, s] = T.cast(dab[t, s] * gate(sh.gam_s, t, s, length), op)
        for t, s in T.Parallel(_C, _C):
            sh.tile_a[t, s] = dab[t, s] * T.cast(sh.inv_s[t, s], f32) * gate(sh.gam_s, t, s, length)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        column_partials(sh.tile_a, sh.col_a, lane)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        for t, s in T.Parallel(_C, _C):
            sh.tile_a[s, t] = dab[t, s] * T.cast(sh.inv_s[t, s], f32) * gate(sh.gam_s, t, s, length)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        column_partials(sh.tile_a, sh.row_a, lane)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        if lane < _C:
            sh.dgam_a_s[lane] = sh.dgam_a_s[lane] + sum_partials(sh.row_a, lane) - sum_partials(sh.col_a, lane)
        # dL = -A~^T dA~ A~^T (strictly lower); dbeta += row sums of dL . KK^T; X = diag(beta) dL
        T.fence_proxy_async()
        T.gemm(sh.inv_s, sh.pm_s, t1, transpose_A=True, clear_accum=True)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        for t, s in T.Parallel(_C, _C):
            sh.pm_s[t, s] = T.cast(t1[t, s], op)
        T.fence_proxy_async()
        T.sync_threads(_SYNC_A, _WARPGROUP)
        T.gemm(sh.pm_s, sh.inv_s, dl, transpose_B=True, clear_accum=True)
        for t, s in T.Parallel(_C, _C):
            dl[t, s] = T.if_then_else(s < t, -dl[t, s], 0.0)
        T.gemm(sh.k_s, sh.k_s, kk, transpose_B=True, clear_accum=True)
        for t, s in T.Parallel(_C, _C):
            sh.tile_a[s, t] = dl[t, s] * kk[t, s]
        T.sync_threads(_SYNC_A, _WARPGROUP)
        column_partials(sh.tile_a, sh.row_a, lane)
        T.sync_threads(_SYNC_A, _WARPGROUP)
        if lane < _C:
            sh.dbeta_s[lane] = sh.dbeta_s[lane] + sum_partials(sh.row_a, lane)
        for t, s in T.Parallel(_C, _C):
            sh.pm_s[t, s] = T.cast(dl[t, s] * sh.b_s[t], op)
        T.fence_proxy_async()
        T.barrier_arrive(sh.x_ready[0])

    @T.macro
    def chain_b(sh, g, i, lane, length, start, head):
        """Warpgroup 1 (lane = tx - 128): dq and dk, and dgamma's dq and dP terms."""
        dq = T.alloc_fragment((_C, K), f32)
        dk = T.alloc_fragment((_C, K), f32)
        ck = T.alloc_fragment((_C, K), f32)
        qk = T.alloc_fragment((_C, _C), f32)
        dpr = T.alloc_fragment((_C, _C), f32)
        row_d = T.alloc_fragment((_C,), f32)
        # sum(S0 . dS1) for dgamma_C: thread `lane` sums column `lane` (8 rows at a time, so that the
        # loads overlap), then each warp adds its 32 columns; the task's last step adds the 4 warps.
        acc = T.alloc_local((8,), f32)
        for r in T.unroll(8):
            acc[r] = 0.0
        for block in T.serial(K // 8):
            for r in T.unroll(8):
                acc[r] = acc[r] + T.cast(sh.ds_s[block * 8 + r, lane], f32) * T.cast(sh.s0_s[block * 8 + r, lane], f32)
        state_dot_b = T.alloc_var(f32)
        state_dot_b = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
        for offset in (16, 8, 4, 2, 1):
            state_dot_b = state_dot_b + T.shfl_xor(state_dot_b, offset)
        if lane % 32 == 0:
            sh.state_dot_s[lane // 32] = state_dot_b
        # dQ's S0 term: scale D dO S0^T, and its dgamma rows
        T.gemm(sh.do_s, sh.s0_s, dq, transpose_B=True, clear_accum=True)
        for t, d in T.Parallel(_C, K):
            dq[t, d] = dq[t, d] * (sh.scale * sh.dec_s[t])
        for t, d in T.Parallel(_C, K):
            ck[t, d] = dq[t, d] * T.cast(sh.q_s[t, d], f32)
        T.reduce_sum(ck, row_d, dim=1, clear=True)
        for t in T.Parallel(_C):
            sh.dgam_b_s[t] = row_d[t]
        # dK's state terms: E Delta dS1^T + dU S0^T
        T.barrier_wait(sh.delta_ready[0], i % 2)
        T.gemm(sh.delta_s, sh.ds_s, dk, transpose_B=True, clear_accum=True)
        for t, d in T.Parallel(_C, K):
            dk[t, d] = dk[t, d] * sh.rdec_s[t]
        T.barrier_wait(sh.du_ready[0], i % 2)
        T.gemm(sh.du_s, sh.s0_s, dk, transpose_B=True)
        T.barrier_arrive(sh.b_free[0])
        # dP = dO Delta^T; dgamma's P terms: row sums minus column sums of scale dP . QK^T . Gm
        # (sh.tile_b: dU's bytes, read for the last time above)
        T.gemm(sh.q_s, sh.k_s, qk, transpose_B=True, clear_accum=True)
        T.gemm(sh.do_s, sh.delta_s, dpr, transpose_B=True, clear_accum=True)
        T.sync_threads(_SYNC_B, _WARPGROUP)
        for t, s in T.Parallel(_C, _C):
            sh.tile_b[t, s] = sh.scale * dpr[t, s] * qk[t, s] * gate(sh.gam_s, t, s, length)
        T.sync_threads(_SYNC_B, _WARPGROUP)
        column_partials(sh.tile_b, sh.col_b, lane)
        T.sync_threads(_SYNC_B, _WARPGROUP)
        for t, s in T.Parallel(_C, _C):
            sh.tile_b[s, t] = sh.scale * dpr[t, s] * qk[t, s] * gate(sh.gam_s, t, s, length)
        T.sync_threads(_SYNC_B, _WARPGROUP)
        column_partials(sh.tile_b, sh.row_b, lane)
        T.sync_threads(_SYNC_B, _WARPGROUP)
        if lane < _C:
            sh.dgam_b_s[lane] = sh.dgam_b_s[lane] + sum_partials(sh.row_b, lane) - sum_partials(sh.col_b, lane)
        # dPm into Ab's tile (chain A's last read of Ab, dW, came before sh.du_ready)
        for t, s in T.Parallel(_C, _C):
            sh.ab_s[t, s] = T.cast(sh.scale * dpr[t, s] * gate(sh.gam_s, t, s, length), op)
        T.fence_proxy_async()
        T.sync_threads(_SYNC_B, _WARPGROUP)
        # dQ += dPm K;  dK += dPm^T Q
        T.gemm(sh.ab_s, sh.k_s, dq)
        for t, d in T.Parallel(_C, K):
            if t < length:
                g.dq_head[start + t, head, d] = T.cast(dq[t, d], op)
        T.gemm(sh.ab_s, sh.q_s, dk, transpose_A=True)
        # dK += (X + X^T) K, X from chain A in Pm's tile
        T.barrier_wait(sh.x_ready[0], i % 2)
        T.gemm(sh.pm_s, sh.k_s, dk)
        T.gemm(sh.pm_s, sh.k_s, dk, transpose_A=True)
        for t, d in T.Parallel(_C, K):
            if t < length:
                g.dk_head[start + t, head, d] = T.cast(dk[t, d], op)

    @T.prim_func
    def chunk_grads_two_chains_kernel(
        q: T.Tensor((num_tokens, num_qk_heads, K), op),
        k: T.Tensor((num_tokens, num_qk_heads, K), op),
        v: T.Tensor((num_tokens, num_v_heads, V), op),
        gamma: T.Tensor((num_tokens, num_v_heads), f32),
        beta: T.Tensor((num_tokens, num_v_heads), f32),
        inverse: T.Tensor((num_tokens, num_v_heads, _C), op),
        chunk_states: T.Tensor((num_chunks, num_v_heads, K, V), op),
        chunk_state_grads: T.Tensor((num_chunks, num_v_heads, K, V), op),
        do: T.Tensor((num_tokens, num_v_heads, V), op),
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),
        dq_head: T.Tensor((num_tokens, num_v_heads, K), op),
        dk_head: T.Tensor((num_tokens, num_v_heads, K), op),
        dv: T.Tensor((num_tokens, num_v_heads, V), op),
        dg: T.Tensor((num_tokens, num_v_heads), f32),
        dbeta: T.Tensor((num_tokens, num_v_heads), f32),
        scale: T.float32,
        num_workers: T.int32,
    ):
        with T.Kernel(num_workers, threads=_THREADS) as worker:
            tx = T.get_thread_binding()
            group = num_v_heads // num_qk_heads
            num_tasks = num_chunks * num_v_heads
            my_tasks = T.ceildiv(num_tasks - worker, num_workers)

            q_s = T.alloc_shared((_C, K), op)
            k_s = T.alloc_shared((_C, K), op)
            do_s = T.alloc_shared((_C, BV), op)
            inv_s = T.alloc_shared((_C, _C), op)
            s0_s = T.alloc_shared((K, BV), op)
            ds_s = T.alloc_shared((K, BV), op)
            pm_s = T.alloc_shared((_C, _C), op)    # Pm, then dA~, T1, X (chain A)
            ab_s = T.alloc_shared((_C, _C), op)    # Ab (chain A), then dPm (chain B)
            w_s = T.alloc_shared((_C, BV), op)     # v (by TMA), turned into W in place
            delta_s = T.alloc_shared((_C, BV), op)
            d_delta_s = T.alloc_shared((_C, BV), op)
            du_s = T.alloc_shared((_C, BV), op)
            tile_a = T.view(d_delta_s, (_C, _C), f32)  # chain A's float32 scratch, after dAb = dDelta W^T
            tile_b = T.view(du_s, (_C, _C), f32)       # chain B's, after dK += dU S0^T
            col_a = T.alloc_shared((_PARTS, _C), f32)
            row_a = T.alloc_shared((_PARTS, _C), f32)
            col_b = T.alloc_shared((_PARTS, _C), f32)
            row_b = T.alloc_shared((_PARTS, _C), f32)
            b_s = T.alloc_shared((_C,), f32)
            gam_s = T.alloc_shared((_C,), f32)
            dec_s = T.alloc_shared((_C,), f32)   # e^{gamma_t}
            rdec_s = T.alloc_shared((_C,), f32)  # e^{gamma_C - gamma_t}
            te_s = T.alloc_shared((_C,), f32)
            dgam_a_s = T.alloc_shared((_C,), f32)
            dgam_b_s = T.alloc_shared((_C,), f32)
            dbeta_s = T.alloc_shared((_C,), f32)
            state_dot_s = T.alloc_shared((_WARPGROUP // 32,), f32)  # chain B's sums of S0 . dS1, one a warp
            loads_a = T.alloc_barrier([1])  # q, k, A~, dO
            loads_b = T.alloc_barrier([1])  # v, S0, dS1
            delta_ready = T.alloc_barrier([_WARPGROUP])
            du_ready = T.alloc_barrier([_WARPGROUP])
            x_ready = T.alloc_barrier([_WARPGROUP])
            b_free = T.alloc_barrier([_THREADS])

            next_gb = T.alloc_local((2,), f32)  # this thread's gamma and beta entries of the next task
            dg_sum = T.alloc_var(f32)
            state_dot = T.alloc_var(f32)
            chunk_id, head, start, length = (T.alloc_var("int32") for _ in range(4))
            next_chunk, next_head, next_start, next_length = (T.alloc_var("int32") for _ in range(4))
            first_chunk, first_head, first_start, first_length = (T.alloc_var("int32") for _ in range(4))

            sh = SimpleNamespace(
                q_s=q_s, k_s=k_s, do_s=do_s, inv_s=inv_s, s0_s=s0_s, ds_s=ds_s, pm_s=pm_s, ab_s=ab_s, w_s=w_s,
                delta_s=delta_s, d_delta_s=d_delta_s, du_s=du_s, tile_a=tile_a, tile_b=tile_b, col_a=col_a,
                row_a=row_a, col_b=col_b, row_b=row_b, b_s=b_s, gam_s=gam_s, dec_s=dec_s, rdec_s=rdec_s,
                te_s=te_s, dgam_a_s=dgam_a_s, dgam_b_s=dgam_b_s, dbeta_s=dbeta_s, state_dot_s=state_dot_s,
                loads_b=loads_b, delta_ready=delta_ready, du_ready=du_ready, x_ready=x_ready, b_free=b_free,
                next_gb=next_gb, scale=scale)
            g = SimpleNamespace(v=v, gamma=gamma, beta=beta, chunk_states=chunk_states,
                                chunk_state_grads=chunk_state_grads, dv=dv, dq_head=dq_head, dk_head=dk_head)

            first_chunk = worker // num_v_heads
            first_head = worker % num_v_heads
            first_start = chunk_bounds[first_chunk, 0]
            first_length = chunk_bounds[first_chunk, 1]
            T.tma_copy(q[first_start:first_start + _C, first_head // group, 0:K], q_s, barrier=loads_a[0])
            T.tma_copy(k[first_start:first_start + _C, first_head // group, 0:K], k_s, barrier=loads_a[0])
            T.tma_copy(inverse[first_start:first_start + _C, first_head, 0:_C], inv_s, barrier=loads_a[0])
            T.tma_copy(do[first_start:first_start + _C, first_head, 0:V], do_s, barrier=loads_a[0])
            if T.shuffle_elect(_THREADS):
                T.barrier_arrive(loads_a[0])
            T.tma_copy(v[first_start:first_start + _C, first_head, 0:V], w_s, barrier=loads_b[0])
            T.tma_copy(chunk_states[first_chunk, first_head, 0:K, 0:V], s0_s, barrier=loads_b[0])
            T.tma_copy(chunk_state_grads[first_chunk, first_head, 0:K, 0:V], ds_s, barrier=loads_b[0])
            if T.shuffle_elect(_THREADS):
                T.barrier_arrive(loads_b[0])
            if tx < _C:
                next_gb[0] = gamma[first_start + T.min(tx, first_length - 1), first_head]
                next_gb[1] = T.if_then_else(tx < first_length, beta[first_start + T.min(tx, first_length - 1),
                                                                    first_head], 0.0)

            for i in T.serial(my_tasks):
                task = worker + i * num_workers
                chunk_id = task // num_v_heads
                head = task % num_v_heads
                start = chunk_bounds[chunk_id, 0]
                length = chunk_bounds[chunk_id, 1]
                has_next = i + 1 < my_tasks
                next_chunk = T.min((task + num_workers) // num_v_heads, num_chunks - 1)
                next_head = (task + num_workers) % num_v_heads
                next_start = chunk_bounds[next_chunk, 0]
                next_length = chunk_bounds[next_chunk, 1]

                if tx < _C:
                    gam_s[tx] = next_gb[0]
                    b_s[tx] = next_gb[1]
                T.sync_threads()
                for t in T.Parallel(_C):
                    dec_s[t] = T.exp(gam_s[t])
                    rdec_s[t] = T.exp(gam_s[_C - 1] - gam_s[t])
                T.sync_threads()
                T.mbarrier_wait_parity(loads_a[0], i % 2)
                T.mbarrier_wait_parity(loads_b[0], i % 2)

                if tx < _WARPGROUP:
                    chain_a(sh, g, i, tx, length, start, head, has_next, next_chunk, next_head, next_start,
                            next_length)
                else:
                    chain_b(sh, g, i, tx - _WARPGROUP, length, start, head)

                # Both chains are done with q, k, A~ and dO: load the next task's group A.
                T.sync_threads()
                if has_next:
                    T.tma_copy(q[next_start:next_start + _C, next_head // group, 0:K], q_s, barrier=loads_a[0])
                    T.tma_copy(k[next_start:next_start + _C, next_head // group, 0:K], k_s, barrier=loads_a[0])
                    T.tma_copy(inverse[next_start:next_start + _C, next_head, 0:_C], inv_s, barrier=loads_a[0])
                    T.tma_copy(do[next_start:next_start + _C, next_head, 0:V], do_s, barrier=loads_a[0])
                    if T.shuffle_elect(_THREADS):
                        T.barrier_arrive(loads_a[0])
                # dg = reverse cumsum of dgamma within the chunk plus the gamma_C terms (as in the
                # lockstep kernel); the sum of S0 . dS1 from chain B's partials.
                if tx < length:
                    state_dot = 0.0
                    for j in T.serial(_WARPGROUP // 32):
                        state_dot = state_dot + state_dot_s[j]
                    dg_sum = state_dot * dec_s[_C - 1]
                    for j in T.serial(_C):
                        dg_sum = dg_sum + T.if_then_else((j >= tx) & (j < length), dgam_a_s[j] + dgam_b_s[j],
                                                         0.0) + te_s[j]
                    dg[start + tx, head] = dg_sum
                    dbeta[start + tx, head] = dbeta_s[tx]
                T.sync_threads()

    return chunk_grads_two_chains_kernel


@functools.lru_cache(maxsize=None)
def compile_chunk_grads_two_chains():
    return compile_for_hopper(two_chain_program(), fast_math=True)
