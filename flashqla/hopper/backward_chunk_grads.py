"""Chunk-parallel gradients of the chunked gated delta rule (docs/gdn-math.md §3.2-3.3).

With the state entering every chunk (S0, from the state-only kernel) and the state gradient
leaving it (dS1, from backward_state_grads.py) every chunk is independent, so the heavy part of
the backward fills the GPU even with few heads. A task is one (chunk, value head): it reads q, k,
v, dO, gamma, beta, A~, S0, dS1 and writes dv, dg, dbeta and this value head's dq, dk (summed
over each head group in backward.py). What keeps the SM busy:

- one persistent CTA per SM walks the tasks worker, worker + W, worker + 2W, ... (W = number of
  CTAs), so an SM never waits for a new CTA to start and load from scratch;
- every tile arrives by TMA (no per-thread synchronous copies), in group B (v, S0, dS1, dO) and
  group A (q, k, A~), each on its own mbarriers;
- the products that read S0 and dS1 come first (U, W, Delta, dDelta, dv, dq's S0 term, dk's
  S0/dS1 terms, sum(S0 . dS1)); v lands in W's buffer and becomes W in place. Right after
  dP = dO Delta^T (dO's last read) group B of the next task is issued into the same buffers, so
  the largest loads (64 KB of states, and dO) fly during the second half of the task. Group A is
  issued after the task's last read of q, k, A~.
- gamma and beta of the next task are read into registers when group B is issued and written to
  shared at the start of the next task (plain loads: TMA cannot fetch a 4-byte column);
- the column sums and the 64 x 64 row sums (dbeta, dgamma) go through a float32 shared tile with
  one thread per (block of rows, column): 2 barriers each, where TileLang's block reduction of a
  transposed fragment took 48 (docs/kernel-notes.md, tenth session);
- every product is issued asynchronously (`T.wgmma_gemm`) and waited for only where its result is
  read (`T.wait_wgmma(n)`: all but the n latest issued are done; the fence after it names the
  accumulator's registers so the compiler keeps its reads below the wait), so independent products
  go out back to back: (K S0, K dS1), (Ab^T dDelta, dDelta W^T, then Delta dS1^T, dO S0^T),
  (dU S0^T, dO Delta^T), (dPm K, dPm^T Q, A~^T dA~), (T1 A~^T, K K^T). 3-5 % faster than waiting
  after each product (docs/kernel-notes.md, twelfth session);
- sum(S0 . dS1), one scalar a task, is made by each thread from shared memory while K S0 and K dS1
  run, then summed per warp; dg's within-chunk suffix sums are warp shuffles.

Every refill is issued by one elected thread after a block-wide barrier that follows the wait for
every product reading the buffers it overwrites, and each
group's barrier is waited on before the first read. No buffer written by TMA shares shared memory
with any other buffer (tests/flashqla/test_hopper_backward_chunk_grads.py checks the generated offsets).

normalize_qk (the op's use_qk_l2norm_in_kernel): q and k arrive as the norm's inputs with its r per row. The
products read the raw tiles and r goes into their float32 row and column factors (q^ = diag(r_q) q), where
scaling the tiles in shared memory, with its barrier, cost 6-8 % of the kernel (docs/kernel-notes.md,
thirty-first session). Two products read dPm and two read X with r on the other side (dPm K^ and dPm^T Q^, X K^ and X^T K^),
so those get a second C x C tile scaled by rows.
"""

import functools

import tilelang.language as T
import torch

from flashqla.hopper.chunk_plan import device_sm_count
from flashqla.hopper.common import CHUNK_SIZE, HEAD_DIM, compile_for_hopper, times_rstd

_C = CHUNK_SIZE
# Two warpgroups. Four (every product split four ways along N, 128 registers a thread) were 1.3-1.5x
# slower on the H200: 300 bytes of spills a thread (docs/kernel-notes.md).
_THREADS = 256
# float32 registers a thread holds of a C x 128 and of a C x C accumulator (what a fence after a wait
# names; TileLang's default would be the whole fragment's element count)
_WIDE = _C * HEAD_DIM // _THREADS
_SQUARE = _C * _C // _THREADS
# Shared buffers filled by TMA: the only ones another task's loads write while this task runs.
TMA_BUFFERS = ("q_s", "k_s", "inv_s", "do_s", "w_s", "s0_s", "ds_s")


def tile_sum_macros(parts: int):
    """(column_partials, sum_partials): column sums of a float32 C x C shared tile by `parts` x C
    threads, one per (block of C / parts rows, column), then the blocks' partials in a fixed order
    (deterministic). TileLang's block reduction of a transposed fragment took 48 barriers per column
    sum; these take the caller's two (one after writing the tile, one after the partials)."""

    @T.macro
    def column_partials(tile, partial, lane):
        """partial[p, s] = the sum of tile[t, s] over the p-th block of rows t (lane: the thread's
        index among the parts x C)."""
        column_sum = T.alloc_var("float32")
        column_sum = 0.0
        for r in T.unroll(_C // parts):
            column_sum = column_sum + tile[(lane // _C) * (_C // parts) + r, lane % _C]
        partial[lane // _C, lane % _C] = column_sum

    @T.macro
    def sum_partials(partial, s):
        """Column s's sum from column_partials."""
        total = T.alloc_var("float32")
        total = partial[0, s]
        for p in T.serial(1, parts):
            total = total + partial[p, s]
        return total

    return column_partials, sum_partials


def chunk_grads_program(normalize_qk: bool = False, l2norm_backward: bool = False):
    """Kernel for K = V = 128, bf16 operands, float32 gamma and beta; head counts, lengths, scale
    and the number of CTAs are run-time values. normalize_qk: q and k are the L2 norm's inputs and the
    kernel also takes their r (float32 [T, Hqk]); it normalises them on chip. l2norm_backward (with
    normalize_qk): it also writes the gradients of the norm's inputs, dq = r (dq^ - q^ (q^ . dq^)) and
    likewise dk, per value head (the norm's backward is linear in dq^, so the sum over a head group is
    still the caller's); without it dq, dk are those of q^, k^."""
    if l2norm_backward and not normalize_qk:
        raise ValueError("chunk_grads_program: l2norm_backward needs normalize_qk (the norm's r)")
    K = V = HEAD_DIM
    BV = V
    num_v_heads = T.dynamic("num_v_heads")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    op = "bfloat16"
    f32 = "float32"
    column_partials, sum_partials = tile_sum_macros(_THREADS // _C)

    def either(buffer, fallback):
        """buffer, or fallback where the plain kernel has none (a helper: an assignment inside a macro
        would rename the buffer)."""
        return fallback if buffer is None else buffer

    @T.macro
    def l2norm_backward_rows(grad, raw_s, rstd_s, products, row_dots):
        """grad (C x K, float32, the gradient of the normalised rows y = r x, x in raw_s, r in rstd_s) becomes
        the gradient of x: r (grad - y (y . grad)) = r grad - r^3 x (x . grad). products (C x K) and
        row_dots (C) are scratch fragments."""
        for t, d in T.Parallel(_C, K):
            products[t, d] = grad[t, d] * T.cast(raw_s[t, d], f32)
        T.reduce_sum(products, row_dots, dim=1, clear=True)
        for t, d in T.Parallel(_C, K):
            grad[t, d] = rstd_s[t] * (grad[t, d] - T.cast(raw_s[t, d], f32) * (rstd_s[t] * rstd_s[t] * row_dots[t]))

    @T.macro
    def walk_tasks(q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, chunk_bounds, dq_head,
                   dk_head, dv, dg, dbeta, scale, num_workers, q_rstd, k_rstd):
        """The persistent CTA's walk over its tasks. q_rstd, k_rstd: the L2 norm's r of q and k [T, Hqk] with
        normalize_qk (else None)."""
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
            # Two C x C tiles reused by phase (one shared allocation each: TileLang does not reuse
            # shared memory across a loop's iterations, and all buffers together exceed 227 KB).
            # pm_s: scale (Gm . QK^T), then dA~, then T1 = A~^T dA~.
            pm_s = T.alloc_shared((_C, _C), op)
            # ab_s: (Gm . A~) diag(beta), then dPm, then diag(beta) dL.
            ab_s = T.alloc_shared((_C, _C), op)
            w_s = T.alloc_shared((_C, BV), op)  # v (by TMA), turned into W = V - D U in place
            delta_s = T.alloc_shared((_C, BV), op)
            d_delta_s = T.alloc_shared((_C, BV), op)
            du_s = T.alloc_shared((_C, BV), op)
            # Float32 C x C scratch for the column and row sums of C x C products, in dDelta's
            # bytes: dDelta is read for the last time (dAb = dDelta W^T) before its first use.
            cc_s = T.view(d_delta_s, (_C, _C), f32)
            col_part_s = T.alloc_shared((_THREADS // _C, _C), f32)
            row_part_s = T.alloc_shared((_THREADS // _C, _C), f32)
            b_s = T.alloc_shared((_C,), f32)
            gam_s = T.alloc_shared((_C,), f32)
            dec_s = T.alloc_shared((_C,), f32)  # e^{gamma_t}
            rdec_s = T.alloc_shared((_C,), f32)  # e^{gamma_C - gamma_t}
            dgam_s = T.alloc_shared((_C,), f32)
            te_s = T.alloc_shared((_C,), f32)
            dbeta_s = T.alloc_shared((_C,), f32)
            dot_part_s = T.alloc_shared((_THREADS // 32,), f32)  # per warp: sum of S0 . dS1
            # per warp of the first two: sum of its rows' dgamma (masked) and of their te
            dgam_part_s = T.alloc_shared((2,), f32)
            te_part_s = T.alloc_shared((2,), f32)
            loads_b = T.alloc_barrier([1])  # v, S0, dS1, dO
            # q, k and A~ are loaded together at the end of a task; A~ has a barrier of its own so that Q K^T
            # need not wait for it. (Refilling q and A~ right after their last reads, earlier in the task,
            # was 0.93-0.97x this: docs/kernel-notes.md, twenty-fifth session.)
            loads_q = T.alloc_barrier([1])
            loads_inv = T.alloc_barrier([1])  # A~
            loads_k = T.alloc_barrier([1])

            qk = T.alloc_fragment((_C, _C), f32)
            gm = T.alloc_fragment((_C, _C), f32)
            ag = T.alloc_fragment((_C, _C), f32)
            u = T.alloc_fragment((_C, BV), f32)
            delta = T.alloc_fragment((_C, BV), f32)
            d_delta = T.alloc_fragment((_C, BV), f32)
            dw = T.alloc_fragment((_C, BV), f32)
            cv = T.alloc_fragment((_C, BV), f32)
            dab = T.alloc_fragment((_C, _C), f32)
            dpr = T.alloc_fragment((_C, _C), f32)
            cc = T.alloc_fragment((_C, _C), f32)
            t1 = T.alloc_fragment((_C, _C), f32)
            dl = T.alloc_fragment((_C, _C), f32)
            kk = T.alloc_fragment((_C, _C), f32)
            dq = T.alloc_fragment((_C, K), f32)
            dk = T.alloc_fragment((_C, K), f32)
            ck = T.alloc_fragment((_C, K), f32)
            row_v = T.alloc_fragment((_C,), f32)  # row sums of C x BV fragments
            row_d = T.alloc_fragment((_C,), f32)  # row sums of C x K fragments (ck: their scratch)
            # normalize_qk: r of this task's q and k rows; the decays with k's r folded in (e^{gamma_t} r_t,
            # e^{gamma_C - gamma_t} r_t); dPm, then X, scaled by r along rows (ab_s has them scaled along columns)
            q_rstd_s = T.alloc_shared((_C,), f32) if normalize_qk else None
            k_rstd_s = T.alloc_shared((_C,), f32) if normalize_qk else None
            dec_k_s = T.alloc_shared((_C,), f32) if normalize_qk else None
            rdec_k_s = T.alloc_shared((_C,), f32) if normalize_qk else None
            rows_s = T.alloc_shared((_C, _C), op) if normalize_qk else None
            if normalize_qk:  # (threads t < C) r of row t of the next task
                q_rstd_next = T.alloc_var(f32)
                k_rstd_next = T.alloc_var(f32)
                rstd_head = T.alloc_var("int32")  # an index's 64-bit division, held once
            gamma_next = T.alloc_var(f32)  # this thread's gamma / beta entry of the next task
            beta_next = T.alloc_var(f32)
            dg_sum = T.alloc_var(f32)  # this thread's row of dg
            dot_acc = T.alloc_local((8,), f32)
            dot = T.alloc_var(f32)
            suffix = T.alloc_var(f32)  # threads t < C: sum of dgamma over rows t.. of t's warp
            shifted = T.alloc_var(f32)
            te_sum = T.alloc_var(f32)
            # A task's indices, held in variables: an expression is inlined into every index that uses
            # it, there as 64-bit divisions by num_v_heads (57 of them in the generated code before).
            chunk_id, head, start, length = (T.alloc_var("int32") for _ in range(4))
            next_chunk, next_head, next_start, next_length = (T.alloc_var("int32") for _ in range(4))
            first_chunk, first_head, first_start, first_length = (T.alloc_var("int32") for _ in range(4))

            # Task 0 of this worker: issue every load group and read its gamma / beta.
            first_chunk = worker // num_v_heads
            first_head = worker % num_v_heads
            first_start = chunk_bounds[first_chunk, 0]
            first_length = chunk_bounds[first_chunk, 1]
            next_start = first_start
            next_length = first_length
            T.tma_copy(q[first_start:first_start + _C, first_head // group, 0:K], q_s, barrier=loads_q[0])
            T.tma_copy(k[first_start:first_start + _C, first_head // group, 0:K], k_s, barrier=loads_k[0])
            T.tma_copy(inverse[first_start:first_start + _C, first_head, 0:_C], inv_s, barrier=loads_inv[0])
            if T.shuffle_elect(_THREADS):
                T.barrier_arrive(loads_q[0])
                T.barrier_arrive(loads_k[0])
                T.barrier_arrive(loads_inv[0])
            T.tma_copy(v[first_start:first_start + _C, first_head, 0:V], w_s, barrier=loads_b[0])
            T.tma_copy(chunk_states[first_chunk, first_head, 0:K, 0:V], s0_s, barrier=loads_b[0])
            T.tma_copy(chunk_state_grads[first_chunk, first_head, 0:K, 0:V], ds_s, barrier=loads_b[0])
            T.tma_copy(do[first_start:first_start + _C, first_head, 0:V], do_s, barrier=loads_b[0])
            if T.shuffle_elect(_THREADS):
                T.barrier_arrive(loads_b[0])
            if tx < _C:
                gamma_next = gamma[first_start + T.min(tx, first_length - 1), first_head]
                beta_next = T.if_then_else(tx < first_length, beta[first_start + T.min(tx, first_length - 1),
                                                                   first_head], 0.0)
                if normalize_qk:  # each row's own r (rows past the tensor are TMA's zeros)
                    rstd_head = first_head // group
                    q_rstd_next = q_rstd[T.min(first_start + tx, num_tokens - 1), rstd_head]
                    k_rstd_next = k_rstd[T.min(first_start + tx, num_tokens - 1), rstd_head]

            for i in T.serial(my_tasks):
                task = worker + i * num_workers
                chunk_id = task // num_v_heads
                head = task % num_v_heads
                # read a task ahead (first_*, then next_* below, for the loads): a load here would stall the
                # task's first mask
                start = next_start
                length = next_length
                has_next = i + 1 < my_tasks
                # Clamped so that the last task's look-ahead reads stay inside chunk_bounds.
                next_chunk = T.min((task + num_workers) // num_v_heads, num_chunks - 1)
                next_head = (task + num_workers) % num_v_heads
                next_start = chunk_bounds[next_chunk, 0]
                next_length = chunk_bounds[next_chunk, 1]

                if tx < _C:
                    gam_s[tx] = gamma_next
                    b_s[tx] = beta_next
                    if normalize_qk:
                        q_rstd_s[tx] = q_rstd_next
                        k_rstd_s[tx] = k_rstd_next
                T.sync_threads()
                for t in T.Parallel(_C):
                    dec_s[t] = T.exp(gam_s[t])
                    rdec_s[t] = T.exp(gam_s[_C - 1] - gam_s[t])
                    if normalize_qk:
                        dec_k_s[t] = dec_s[t] * k_rstd_s[t]
                        rdec_k_s[t] = rdec_s[t] * k_rstd_s[t]
                for t, s in T.Parallel(_C, _C):
                    gm[t, s] = T.if_then_else((s <= t) & (t < length), T.exp(gam_s[t] - gam_s[s]), 0.0)

                # Whole tiles: rows past the sequence end hold the next sequence's data (or TMA's
                # zeros past the tensor); masked rows of Gm and beta and of dgamma keep them out.
                T.mbarrier_wait_parity(loads_q[0], i % 2)
                T.mbarrier_wait_parity(loads_k[0], i % 2)
                T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                if normalize_qk:  # Q^ K^T = diag(r_q) Q K^T diag(r_k)
                    for t, s in T.Parallel(_C, _C):
                        qk[t, s] = qk[t, s] * q_rstd_s[t] * k_rstd_s[s]
                for t, s in T.Parallel(_C, _C):
                    pm_s[t, s] = T.cast(scale * qk[t, s] * gm[t, s], op)
                T.mbarrier_wait_parity(loads_inv[0], i % 2)
                for t, s in T.Parallel(_C, _C):
                    ag[t, s] = T.cast(inv_s[t, s], f32) * gm[t, s]
                for t, s in T.Parallel(_C, _C):
                    ab_s[t, s] = T.cast(ag[t, s] * b_s[s], op)

                # Group B phase. U = K S0 and K dS1 are issued together; the sum of S0 . dS1 (dgamma_C's
                # term) is made from shared memory while the tensor cores run them.
                T.mbarrier_wait_parity(loads_b[0], i % 2)
                T.wgmma_gemm(k_s, s0_s, u, clear_accum=True)
                T.wgmma_gemm(k_s, ds_s, d_delta, clear_accum=True)
                for j in T.vectorized(8):
                    dot_acc[j] = 0.0
                for c in T.serial(BV // 16):
                    for j in T.vectorized(8):
                        dot_acc[j] = dot_acc[j] + T.cast(s0_s[tx // 2, (tx % 2) * (BV // 2) + c * 8 + j], f32) \
                            * T.cast(ds_s[tx // 2, (tx % 2) * (BV // 2) + c * 8 + j], f32)
                dot = dot_acc[0]
                for j in T.serial(1, 8):
                    dot = dot + dot_acc[j]
                dot = T.warp_reduce_sum(dot)
                if tx % 32 == 0:
                    dot_part_s[tx // 32] = dot

                # W = V - D U (in v's buffer), Delta = Ab W
                T.wait_wgmma(1)
                T.warpgroup_fence_operand(u, num_regs=_WIDE)
                for t, d in T.Parallel(_C, BV):
                    w_s[t, d] = T.cast(T.cast(w_s[t, d], f32) - either(dec_k_s, dec_s)[t] * u[t, d], op)
                T.wgmma_gemm(ab_s, w_s, delta, clear_accum=True)
                # dDelta = E K dS1 + Pm^T dO;  the E term also feeds dgamma (te).
                T.wait_wgmma(1)
                T.warpgroup_fence_operand(d_delta, num_regs=_WIDE)
                for t, d in T.Parallel(_C, BV):
                    d_delta[t, d] = d_delta[t, d] * either(rdec_k_s, rdec_s)[t]
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(delta, num_regs=_WIDE)
                for t, d in T.Parallel(_C, BV):
                    delta_s[t, d] = T.cast(delta[t, d], op)
                for t, d in T.Parallel(_C, BV):
                    cv[t, d] = delta[t, d] * d_delta[t, d]
                T.reduce_sum(cv, row_v, dim=1, clear=True)
                for t in T.Parallel(_C):
                    te_s[t] = row_v[t]
                T.wgmma_gemm(pm_s, do_s, d_delta, transpose_A=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(d_delta, num_regs=_WIDE)
                for t, d in T.Parallel(_C, BV):
                    d_delta_s[t, d] = T.cast(d_delta[t, d], op)

                # dW = Ab^T dDelta = dV (dU = -D dW) and dAb = dDelta W^T (W's last read)
                T.wgmma_gemm(ab_s, d_delta_s, dw, transpose_A=True, clear_accum=True)
                T.wgmma_gemm(d_delta_s, w_s, dab, transpose_B=True, clear_accum=True)
                T.wait_wgmma(1)
                T.warpgroup_fence_operand(dw, num_regs=_WIDE)
                for t, d in T.Parallel(_C, BV):
                    if t < length:
                        dv[start + t, head, d] = T.cast(dw[t, d], op)
                for t, d in T.Parallel(_C, BV):
                    dw[t, d] = -dec_s[t] * dw[t, d]
                for t, d in T.Parallel(_C, BV):
                    cv[t, d] = dw[t, d] * u[t, d]
                T.reduce_sum(cv, row_v, dim=1, clear=True)
                for t in T.Parallel(_C):  # U^ = diag(r_k) U
                    dgam_s[t] = times_rstd(row_v[t], k_rstd_s, t) - te_s[t]
                for t, d in T.Parallel(_C, BV):
                    du_s[t, d] = T.cast(dw[t, d], op)
                # dK's first state term E Delta dS1^T (dS1's last read) and dQ's S0 term scale D dO S0^T
                T.wgmma_gemm(delta_s, ds_s, dk, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(do_s, s0_s, dq, transpose_B=True, clear_accum=True)
                T.wait_wgmma(2)
                T.warpgroup_fence_operand(dab, num_regs=_SQUARE)
                # dbeta = column sums of dAb . Ag, in dDelta's bytes: both warpgroups' reads of dDelta
                # must be over (the barrier), not only this warpgroup's (the wait).
                T.sync_threads()
                for t, s in T.Parallel(_C, _C):
                    cc_s[t, s] = dab[t, s] * ag[t, s]
                T.sync_threads()
                column_partials(cc_s, col_part_s, tx)
                T.sync_threads()
                if tx < _C:
                    dbeta_s[tx] = sum_partials(col_part_s, tx)
                for t, s in T.Parallel(_C, _C):
                    dab[t, s] = dab[t, s] * b_s[s]
                for t, s in T.Parallel(_C, _C):
                    pm_s[t, s] = T.cast(dab[t, s] * gm[t, s], op)  # dA~
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dk, num_regs=_WIDE)
                T.warpgroup_fence_operand(dq, num_regs=_WIDE)
                for t, d in T.Parallel(_C, K):
                    dk[t, d] = dk[t, d] * rdec_s[t]
                for t, d in T.Parallel(_C, K):
                    dq[t, d] = dq[t, d] * (scale * dec_s[t])
                for t, d in T.Parallel(_C, K):
                    ck[t, d] = dq[t, d] * T.cast(q_s[t, d], f32)
                T.reduce_sum(ck, row_d, dim=1, clear=True)
                for t in T.Parallel(_C):
                    dgam_s[t] = dgam_s[t] + times_rstd(row_d[t], q_rstd_s, t)
                # with dP = scale dO Delta^T
                T.wgmma_gemm(du_s, s0_s, dk, transpose_B=True)
                T.wgmma_gemm(do_s, delta_s, dpr, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dk, num_regs=_WIDE)
                T.warpgroup_fence_operand(dpr, num_regs=_SQUARE)

                # W (v's buffer), S0, dS1 and dO are read for the last time above: load the next task's
                # group B (and its gamma / beta) while the rest of this task runs.
                T.sync_threads()
                if has_next:
                    T.tma_copy(v[next_start:next_start + _C, next_head, 0:V], w_s, barrier=loads_b[0])
                    T.tma_copy(chunk_states[next_chunk, next_head, 0:K, 0:V], s0_s, barrier=loads_b[0])
                    T.tma_copy(chunk_state_grads[next_chunk, next_head, 0:K, 0:V], ds_s, barrier=loads_b[0])
                    T.tma_copy(do[next_start:next_start + _C, next_head, 0:V], do_s, barrier=loads_b[0])
                    if T.shuffle_elect(_THREADS):
                        T.barrier_arrive(loads_b[0])
                    if tx < _C:
                        gamma_next = gamma[next_start + T.min(tx, next_length - 1), next_head]
                        beta_next = T.if_then_else(tx < next_length,
                                                   beta[next_start + T.min(tx, next_length - 1), next_head], 0.0)
                        if normalize_qk:
                            rstd_head = next_head // group
                            q_rstd_next = q_rstd[T.min(next_start + tx, num_tokens - 1), rstd_head]
                            k_rstd_next = k_rstd[T.min(next_start + tx, num_tokens - 1), rstd_head]

                # dGm terms give dgamma (row sums minus column sums): the column sums from cc_s, the
                # row sums as the column sums of its transpose.
                for t, s in T.Parallel(_C, _C):
                    cc[t, s] = dab[t, s] * ag[t, s] + scale * dpr[t, s] * qk[t, s] * gm[t, s]
                for t, s in T.Parallel(_C, _C):
                    cc_s[t, s] = cc[t, s]
                T.sync_threads()
                column_partials(cc_s, col_part_s, tx)
                T.sync_threads()
                for t, s in T.Parallel(_C, _C):
                    cc_s[s, t] = cc[t, s]
                T.sync_threads()
                column_partials(cc_s, row_part_s, tx)
                T.sync_threads()
                if tx < _C:
                    dgam_s[tx] = dgam_s[tx] + sum_partials(row_part_s, tx) - sum_partials(col_part_s, tx)
                for t, s in T.Parallel(_C, _C):
                    ab_s[t, s] = T.cast(times_rstd(scale * dpr[t, s] * gm[t, s], k_rstd_s, s), op)  # dPm
                if normalize_qk:
                    for t, s in T.Parallel(_C, _C):
                        rows_s[t, s] = T.cast(scale * dpr[t, s] * gm[t, s] * q_rstd_s[t], op)

                # dQ += dPm K;  dK += dPm^T Q;  T1 = A~^T dA~
                T.wgmma_gemm(ab_s, k_s, dq)
                T.wgmma_gemm(either(rows_s, ab_s), q_s, dk, transpose_A=True)
                T.wgmma_gemm(inv_s, pm_s, t1, transpose_A=True, clear_accum=True)
                T.wait_wgmma(2)
                T.warpgroup_fence_operand(dq, num_regs=_WIDE)
                if l2norm_backward:
                    l2norm_backward_rows(dq, q_s, q_rstd_s, ck, row_d)
                for t, d in T.Parallel(_C, K):
                    if t < length:
                        dq_head[start + t, head, d] = T.cast(dq[t, d], op)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dk, num_regs=_WIDE)
                T.warpgroup_fence_operand(t1, num_regs=_SQUARE)
                T.sync_threads()  # every warpgroup has read dA~ before T1 overwrites it
                for t, s in T.Parallel(_C, _C):
                    pm_s[t, s] = T.cast(t1[t, s], op)
                # dL = -A~^T dA~ A~^T (strictly lower) with L_ts = beta_t k_t.k_s, and K K^T
                T.wgmma_gemm(pm_s, inv_s, dl, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dl, num_regs=_SQUARE)
                T.warpgroup_fence_operand(kk, num_regs=_SQUARE)
                for t, s in T.Parallel(_C, _C):
                    dl[t, s] = T.if_then_else(s < t, -dl[t, s], 0.0)
                # dbeta += row sums of dL . KK^T, as the column sums of its transpose (cc_s is free:
                # its last reads were before the two barriers since)
                for t, s in T.Parallel(_C, _C):
                    cc_s[s, t] = times_rstd(times_rstd(dl[t, s] * kk[t, s], k_rstd_s, t), k_rstd_s, s)
                T.sync_threads()
                column_partials(cc_s, row_part_s, tx)
                T.sync_threads()
                if tx < _C:
                    dbeta_s[tx] = dbeta_s[tx] + sum_partials(row_part_s, tx)
                # dK += (X + X^T) K with X = diag(beta) dL: two products instead of a transpose
                # through shared memory.
                T.sync_threads()  # every warpgroup has read dPm before X overwrites it
                for t, s in T.Parallel(_C, _C):
                    ab_s[t, s] = T.cast(times_rstd(dl[t, s] * b_s[t], k_rstd_s, s), op)
                if normalize_qk:
                    for t, s in T.Parallel(_C, _C):
                        rows_s[t, s] = T.cast(dl[t, s] * b_s[t] * k_rstd_s[t], op)
                T.wgmma_gemm(ab_s, k_s, dk)
                T.wgmma_gemm(either(rows_s, ab_s), k_s, dk, transpose_A=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dk, num_regs=_WIDE)
                if l2norm_backward:
                    l2norm_backward_rows(dk, k_s, k_rstd_s, ck, row_d)

                # q, k and A~ are read for the last time above: load the next task's.
                T.sync_threads()
                if has_next:
                    T.tma_copy(k[next_start:next_start + _C, next_head // group, 0:K], k_s, barrier=loads_k[0])
                    T.tma_copy(q[next_start:next_start + _C, next_head // group, 0:K], q_s, barrier=loads_q[0])
                    T.tma_copy(inverse[next_start:next_start + _C, next_head, 0:_C], inv_s, barrier=loads_inv[0])
                    if T.shuffle_elect(_THREADS):
                        T.barrier_arrive(loads_k[0])
                        T.barrier_arrive(loads_q[0])
                        T.barrier_arrive(loads_inv[0])

                for t, d in T.Parallel(_C, K):
                    if t < length:
                        dk_head[start + t, head, d] = T.cast(dk[t, d], op)

                # dg_t = e^{gamma_C} sum(S0 . dS1) + sum_j te_j + sum_{j >= t} dgamma_j (rows j < length): the
                # suffix sums by shuffles in the first two warps (one row a thread), then warp 0 adds
                # warp 1's total. All in a fixed order: deterministic.
                if tx < _C:
                    suffix = T.if_then_else(tx < length, dgam_s[tx], 0.0)
                    for o in T.unroll(5):
                        shifted = T.shfl_down(suffix, 1 << o)
                        suffix = suffix + T.if_then_else(tx % 32 + (1 << o) < 32, shifted, 0.0)
                    te_sum = T.warp_reduce_sum(te_s[tx])
                    if tx % 32 == 0:
                        dgam_part_s[tx // 32] = suffix
                        te_part_s[tx // 32] = te_sum
                T.sync_threads()
                if tx < length:
                    dg_sum = dot_part_s[0]
                    for w in T.serial(1, _THREADS // 32):
                        dg_sum = dg_sum + dot_part_s[w]
                    dg_sum = dg_sum * dec_s[_C - 1] + (te_part_s[0] + te_part_s[1])
                    dg_sum = dg_sum + suffix + T.if_then_else(tx < 32, dgam_part_s[1], 0.0)
                    dg[start + tx, head] = dg_sum
                    dbeta[start + tx, head] = dbeta_s[tx]
                # The next task overwrites the small shared arrays read just above.
                T.sync_threads()

    if normalize_qk:
        @T.prim_func
        def chunk_grads_normalizing_kernel(
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
            q_rstd: T.Tensor((num_tokens, num_qk_heads), f32),
            k_rstd: T.Tensor((num_tokens, num_qk_heads), f32),
        ):
            walk_tasks(q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, chunk_bounds, dq_head,
                       dk_head, dv, dg, dbeta, scale, num_workers, q_rstd, k_rstd)

        return chunk_grads_normalizing_kernel

    @T.prim_func
    def chunk_grads_kernel(
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
        walk_tasks(q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, chunk_bounds, dq_head,
                   dk_head, dv, dg, dbeta, scale, num_workers, None, None)

    return chunk_grads_kernel


@functools.lru_cache(maxsize=None)
def compile_chunk_grads(normalize_qk: bool = False, l2norm_backward: bool = False):
    return compile_for_hopper(chunk_grads_program(normalize_qk, l2norm_backward), fast_math=True)


def chunk_gradients(q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, scale, chunk_bounds,
                    num_workers: int | None = None, q_rstd=None, k_rstd=None, l2norm_backward: bool = True):
    """Run the kernel on flattened inputs; returns (dq, dk per value head, dv, dg, dbeta).

    q, k: [T, Hqk, 128] bf16; v, do: [T, Hv, 128] bf16; gamma (chunk-local cumsum), beta: [T, Hv] fp32;
    inverse: [T, Hv, 64] bf16; chunk_states (entering each chunk), chunk_state_grads (leaving it):
    [num_chunks, Hv, 128, 128] bf16 in chunk order; chunk_bounds: int32 [num_chunks, 2], every chunk's
    (first token, number of tokens) (chunk_plan.chunk_bounds, ForwardPlan.chunk_bounds); num_workers
    (CTAs) defaults to the SM count. q_rstd, k_rstd (float32 [T, Hqk], both or neither): q, k are the inputs of
    the L2 norm (flashqla/hopper/l2norm.py) with these r, and the gradients are those of q^, k^'s; dq, dk then
    come back as the gradients of q, k, or with l2norm_backward=False of q^, k^ (whose sum over a head group
    the caller takes through l2norm.l2norm_backward).
    dq, dk, dv: bf16 [T, Hv, 128]; dg, dbeta: float32 [T, Hv].
    """
    num_tokens, _, head_dim = q.shape
    num_v_heads = v.shape[1]
    f32 = dict(dtype=torch.float32, device=q.device)
    bf16 = dict(dtype=torch.bfloat16, device=q.device)
    dq_head = torch.empty(num_tokens, num_v_heads, head_dim, **bf16)
    dk_head = torch.empty(num_tokens, num_v_heads, head_dim, **bf16)
    dv = torch.empty(num_tokens, num_v_heads, head_dim, **bf16)
    dg = torch.empty(num_tokens, num_v_heads, **f32)
    dbeta = torch.empty(num_tokens, num_v_heads, **f32)
    num_chunks = chunk_bounds.shape[0]
    if num_chunks > 0:
        if num_workers is None:
            num_workers = device_sm_count(q.device)
        num_workers = max(1, min(num_workers, num_chunks * num_v_heads))
        args = (q, k, v, gamma, beta, inverse, chunk_states, chunk_state_grads, do, chunk_bounds, dq_head, dk_head, dv,
                dg, dbeta, float(scale), num_workers)
        if q_rstd is None:
            compile_chunk_grads()(*args)
        else:
            compile_chunk_grads(True, l2norm_backward)(*args, q_rstd, k_rstd)
    return dq_head, dk_head, dv, dg, dbeta
