"""Forward (and backward) timings of our kernels beside FLA's and FlashQLA's, all three per shape;
and side-by-side timings of kernel variants (--compare).

    python -m flashqla.bench [--fwd] [--bwd] [--json PATH] [--shapes SUBSTR,...] [--baselines fla,flashqla]
                             [--time-budget SECONDS] [--breakdown] [--model] [--keep true|products|false]
    python -m flashqla.bench --compare [keep_forward,conv,inverse,forward_walk,backward_fused,piece_plans]
                             [--json PATH]

Each library is called the way its users call it: ours through `flashqla.chunk_gated_delta_rule`
(backend="tilelang", input checks included), FLA through its `chunk_gated_delta_rule` beneath
fla-core's backend dispatch (`flashqla.fla_baseline.fla_chunk_gated_delta_rule`: FLA's own
kernels, what FLA_FLASH_QLA=0 gives, else FLA hands the call to FlashQLA), FlashQLA through
`flash_qla.chunk_gated_delta_rule`; cu_seqlens is made once per shape in the dtype each expects.
Ours and FLA also get the offsets' host copy (`cu_seqlens_cpu`, as the model passes it), which
spares both a device->host read per call; FlashQLA's signature has no such argument.
--no-host-offsets times the synchronising call instead.
Inputs as in the anchors' benchmark: bf16 q/k/v (q, k L2-normalised), fp32 g = logsigmoid(randn)/16,
fp32 beta = sigmoid(rand), fp32 initial state, final state on, K = V = 128, B = 1 with cu_seqlens.
Median of triton.testing.do_bench; forward under no_grad; backward = (forward + backward) - forward.
--model calls the op as the model's GDN layer does instead, on its head layouts (16/16 at 32768 and
131072 tokens, 8/8 at 131072): q, k not normalised with use_qk_l2norm_in_kernel=True, bf16 beta, no
initial or final state, and the forward timed under autograd (what it keeps for the backward included:
--keep picks our op's keep_for_backward, true by default as the op's; the model configs keep "inverse").
Per shape it also records each library's first call (compile included: FlashQLA compiles about a
dozen TileLang kernels per head layout, minutes without a carried TileLang cache) and the relative
L2 distance of o and the final state from FLA's.
--breakdown adds our per-stage times (planning uncached and cached, gamma with the inverse, walk
starts, the fused walk; with --model also the inverse with the L2 norm in its kernel, the norm alone,
and the walk storing the chunk states), and with --bwd the backward's (the reverse walk, its warm-up
ends, the norm's backward or the group sum, and the walk that keep_for_backward="inverse" adds).
--time-budget starts no shape that would likely end past the budget; the JSON is rewritten after every
shape, so a killed run keeps what it measured. --warm-only makes only the first calls: FLA's compile
and autotuning take about two minutes per head layout, so tools/device_session.sh runs one such process
per layout in parallel (autotune results not kept, FLA_CACHE_RESULTS=0) and the timed run then
autotunes alone with every kernel already compiled.

--compare times what decides between kernel variants, each pair on the same inputs, and prints the
ratios (timings live here, not in the GPU tests, so a busy machine cannot fail a correctness test):
- keep_forward: forward + backward through the public op, keep_for_backward=False, "inverse" and True;
- conv: the GDN layer's conv + SiLU, the TileLang kernel against torch.compile of its definition, and
  the kernel's backward with 256-token blocks against 128 and 64;
- inverse: the chunks' inverse A~ against FlashQLA's kkt_solve;
- forward_walk: the forward walk against its candidates (WALK_CANDIDATES), bitwise or it raises;
- backward_fused: the reverse walk from the kept forward, and where each value head has its own q, k head
  the candidate with the L2 norm's backward inside it (tools/device_session.sh fused-bench times a form);
- piece_plans: the forward and the backward with the plan's equal pieces against ragged cuts (a candidate) on
  the grouped shapes where the plans differ.
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

from flashqla.api import KEEP_FOR_BACKWARD

HEAD_LAYOUTS = {"TP1": (16, 64), "TP1.33": (16, 48), "TP2": (16, 32), "TP2'": (8, 32), "TP2.67": (8, 24),
                "TP4": (4, 16), "TP8": (2, 8), "16/16": (16, 16)}
LENGTHS = {"1x8192": [8192], "1x32768": [32768], "28672+4096": [28672, 4096], "8192x4": [8192] * 4}
DIFFERENTIABLE_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
# --keep: the op's keep_for_backward values by their command-line names (true, inverse, false)
KEEP_CHOICES = {str(value).lower(): value for value in KEEP_FOR_BACKWARD}


# The GDN layers of the models we train: 0.8B and 2B (16/16 heads), the same at tp = 2 (8/8), and 4B and 9B
# (16/32: grouped value heads).
MODEL_SHAPES = [("16/16 1x32768", (16, 16), [32768]), ("16/16 1x131072", (16, 16), [131072]),
                ("8/8 1x131072", (8, 8), [131072]), ("16/32 1x65536", (16, 32), [65536])]
# The bench's long rows besides its 33 shapes: the 0.8B model's layer at 128k, alone and at tp = 2.
LONG_SHAPES = [("16/16 1x131072", (16, 16), [131072]), ("8/8 1x131072", (8, 8), [131072])]


def bench_shapes() -> list[tuple[str, tuple[int, int], list[int]]]:
    shapes = [(f"{a}/{b} {length}", (a, b), lens)
              for (a, b) in HEAD_LAYOUTS.values() for length, lens in LENGTHS.items()]
    shapes.append(("2/8 1x131072", (2, 8), [131072]))
    return shapes + LONG_SHAPES


def make_inputs(heads: tuple[int, int], seq_lens: list[int], seed: int = 0, like_the_model: bool = False,
                device="cuda") -> dict:
    """The op's arguments. like_the_model: as the model's GDN layer passes them (q, k not normalised,
    with use_qk_l2norm_in_kernel; beta in bf16 from the bf16 projection; no initial or final state);
    else the anchors' inputs (normalised q, k, fp32 beta, initial and final state)."""
    num_qk_heads, num_v_heads = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(seq_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q, k = randn(1, total, num_qk_heads, 128), randn(1, total, num_qk_heads, 128)
    if not like_the_model:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.rand(1, total, num_v_heads, generator=gen, device=device).sigmoid()
    return dict(
        q=q.to(torch.bfloat16), k=k.to(torch.bfloat16), v=randn(1, total, num_v_heads, 128).to(torch.bfloat16),
        g=F.logsigmoid(randn(1, total, num_v_heads)) / 16,
        beta=beta.to(torch.bfloat16) if like_the_model else beta,
        initial_state=None if like_the_model else randn(len(seq_lens), num_v_heads, 128, 128),
        output_final_state=not like_the_model,
        use_qk_l2norm_in_kernel=like_the_model,
        cu_seqlens=torch.tensor([0, *seq_lens], device=device).cumsum(0).to(torch.int32),
        cu_seqlens_long=torch.tensor([0, *seq_lens], device=device).cumsum(0),
        cu_seqlens_cpu=torch.tensor([0, *seq_lens]).cumsum(0),
    )


def _leaves(inputs: dict) -> dict:
    """Fresh leaves requiring grad for the differentiable inputs the call has."""
    return {name: inputs[name].detach().requires_grad_(True) for name in DIFFERENTIABLE_INPUTS
            if inputs[name] is not None}


def _differentiated(o, final_state) -> tuple:
    """The outputs autograd differentiates: the final state only where the call makes one."""
    return (o,) if final_state is None else (o, final_state)


def _output_grads_for(outputs: tuple, seed: int = 1) -> tuple:
    gen = torch.Generator(device=outputs[0].device).manual_seed(seed)
    return tuple(torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype) for t in outputs)


def implementations(baselines: list[str], host_offsets: bool = True, backend: str = "tilelang",
                    keep_for_backward: bool | str = True) -> dict:
    """name -> f(inputs) returning (o, final_state or None); ours first (through `backend`, with
    `keep_for_backward`). Each calls its library's public op with the inputs' state and L2-norm flags."""
    from flashqla import chunk_gated_delta_rule as ours_op

    def host_copy(x):
        return x["cu_seqlens_cpu"] if host_offsets else None

    def flags(x):
        return dict(initial_state=x["initial_state"], output_final_state=x["output_final_state"],
                    use_qk_l2norm_in_kernel=x["use_qk_l2norm_in_kernel"])

    def ours(x):
        return ours_op(x["q"], x["k"], x["v"], x["g"], x["beta"], **flags(x), cu_seqlens=x["cu_seqlens"],
                       cu_seqlens_cpu=host_copy(x), backend=backend, keep_for_backward=keep_for_backward)

    impls = {"ours": ours}
    if "fla" in baselines:
        from flashqla.fla_baseline import fla_chunk_gated_delta_rule

        try:
            fla_op = fla_chunk_gated_delta_rule()
        except ImportError:
            print("fla-core not installed: FLA column skipped")
        else:
            def fla(x):
                return fla_op(x["q"], x["k"], x["v"], x["g"], x["beta"], **flags(x), cu_seqlens=x["cu_seqlens_long"],
                              cu_seqlens_cpu=host_copy(x))
            impls["fla"] = fla
    if "flashqla" in baselines:
        try:
            from flash_qla import chunk_gated_delta_rule as flashqla_op
        except ImportError:
            print("flash-qla not installed: FlashQLA column skipped")
        else:
            def flashqla(x):
                return flashqla_op(x["q"], x["k"], x["v"], x["g"], x["beta"], **flags(x), cu_seqlens=x["cu_seqlens_long"])
            impls["flashqla"] = flashqla
    return impls


def _breakdown_operands(inputs: dict, like_the_model: bool):
    """The kernels' flattened operands for the stage timings: q, k, v, g, beta as given, and with
    like_the_model (the op normalises q and k in its kernels) the norm's r of q and k ([T, Hqk] each;
    else None)."""
    from flashqla.hopper.l2norm import l2_normalized

    q, k, v, g, beta = (inputs[n][0] for n in ("q", "k", "v", "g", "beta"))
    rstds = None
    if like_the_model:
        rstds = tuple(l2_normalized(x)[1].view(x.shape[:2]) for x in (q, k))
    return q, k, v, g, beta, rstds


def forward_breakdown(inputs: dict, rep_ms: int, like_the_model: bool = False) -> dict:
    """Median ms of each stage of our forward (planning, gamma with the inverse, walk starts, the fused
    walk). like_the_model adds the inverse with the L2 norm in its kernel (the op's), the norm alone, and
    the walk a differentiated forward keeping everything runs (it also stores the chunk states)."""
    from triton.testing import do_bench

    from flashqla.hopper.l2norm import l2_normalized
    from flashqla.hopper.chunk_plan import build_forward_plan, plan_forward
    from flashqla.hopper.forward import walk_chunks
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK
    from flashqla.hopper.inverse import gamma_and_inverse
    from flashqla.hopper.walk_bounds import walk_bounds

    q, k, v, g, beta, rstds = _breakdown_operands(inputs, like_the_model)
    h0 = inputs["initial_state"]
    cu = inputs["cu_seqlens"]
    bounds = cu.tolist()
    num_v_heads = g.shape[1]
    sm_count = torch.cuda.get_device_properties().multi_processor_count
    plan = plan_forward(cu, num_v_heads, 128, sm_count, MAX_VALUE_BLOCK)
    gamma, inverse, *_ = gamma_and_inverse(k, g, beta, plan.chunk_bounds, normalize_q=q if like_the_model else None)

    def walk(**stores):
        return walk_chunks(q, k, v, gamma, beta, inverse, 128 ** -0.5, h0, cu, plan, **stores, rstds=rstds)

    stages = {
        # uncached: the first layer of a step with new cu_seqlens (one device->host read included)
        "plan": lambda: build_forward_plan(cu.tolist(), cu.device, num_v_heads, 128, sm_count, MAX_VALUE_BLOCK),
        # cached, with the host bounds the public op already holds (no sync): every later layer
        "plan_cached": lambda: plan_forward(cu, num_v_heads, 128, sm_count, MAX_VALUE_BLOCK,
                                            host_bounds=bounds),
        "gamma_inverse": lambda: gamma_and_inverse(k, g, beta, plan.chunk_bounds),
        "walk_starts": lambda: walk_bounds(gamma, plan.pieces, cu, ahead=False),
        "walk": walk,  # walk starts included
    }
    if like_the_model:
        # the op's: gamma and the inverse with the norm's r of q and k from the same kernel (the walks above
        # apply r); "l2norm" the norm as a kernel of its own, writing q^ and k^
        stages["gamma_inverse_norm"] = lambda: gamma_and_inverse(k, g, beta, plan.chunk_bounds, normalize_q=q)
        stages["l2norm"] = lambda: (l2_normalized(inputs["q"]), l2_normalized(inputs["k"]))
        stages["walk_keeping_states"] = lambda: walk(store_chunk_states=True)
    result = {name: do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") for name, fn in stages.items()}
    result["pieces"] = int(plan.pieces.shape[0])
    result["value_block"] = plan.value_block
    return result


def backward_breakdown(inputs: dict, rep_ms: int, like_the_model: bool = False) -> dict:
    """Median ms of each stage of our backward given the kept forward: the warm-up ends of the pieces, the
    reverse walk, the L2 norm's backward with dq's sum over each head group (like_the_model) or the group sum
    alone (dk's is the same again), and the walk that keep_for_backward="inverse" adds (the chunk states
    rebuilt)."""
    from triton.testing import do_bench

    from flashqla.hopper.backward import sum_over_groups
    from flashqla.hopper.backward_fused import fused_backward_grads
    from flashqla.hopper.chunk_plan import plan_forward
    from flashqla.hopper.forward import forward, walk_chunks
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK
    from flashqla.hopper.l2norm import l2norm_backward
    from flashqla.hopper.walk_bounds import walk_bounds

    q, k, v, g, beta, rstds = _breakdown_operands(inputs, like_the_model)
    h0 = inputs["initial_state"]
    cu = inputs["cu_seqlens"]
    num_v_heads = g.shape[1]
    num_qk_heads = q.shape[1]
    sm_count = torch.cuda.get_device_properties().multi_processor_count
    plan = plan_forward(cu, num_v_heads, 128, sm_count, MAX_VALUE_BLOCK)
    _, _, kept, *_ = forward(q[None], k[None], v[None], g[None], beta[None], 128 ** -0.5, h0, False, cu,
                             keep_for_backward=True, normalize_qk=like_the_model)
    gamma, beta32, inverse = kept.gamma, beta.float(), kept.inverse
    do = torch.randn_like(v)
    dht = torch.zeros(cu.numel() - 1, num_v_heads, 128, 128, device=v.device)
    walk_end = walk_bounds(gamma, plan.pieces, cu, ahead=True)

    def reverse_walk():
        return fused_backward_grads(q, k, v, gamma, beta32, inverse, kept.chunk_states, do, dht, 128 ** -0.5, cu,
                                    plan.chunk_offsets, plan.pieces, walk_end, rstds=rstds)

    dq_head = reverse_walk()[0]
    stages = {
        "walk_ends": lambda: walk_bounds(gamma, plan.pieces, cu, ahead=True),
        "reverse_walk": reverse_walk,
        "rewalk": lambda: walk_chunks(q, k, v, gamma, beta32, inverse, 128 ** -0.5, h0, cu, plan,
                                      store_chunk_states=True, rstds=rstds),
    }
    if rstds is not None:
        stages["l2norm_group_sum"] = lambda: l2norm_backward(dq_head.view(-1, 128), q.reshape(-1, 128),
                                                              rstds[0].reshape(-1))
    elif num_v_heads > num_qk_heads:
        stages["group_sum"] = lambda: sum_over_groups(dq_head, num_qk_heads, q.dtype)
    return {name: do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") for name, fn in stages.items()}


def first_call_s(fn, inputs) -> float:
    """Wall seconds of one forward + backward, compiles included when they have not happened yet."""
    leaves = _leaves(inputs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = _differentiated(*fn(dict(inputs, **leaves)))
    torch.autograd.backward(outputs, _output_grads_for(outputs))
    torch.cuda.synchronize()
    return time.perf_counter() - started


def distance_from(reference, fn, inputs) -> dict:
    """Relative L2 distance of fn's o and final state from the reference library's."""
    from flashqla.testing import relative_error

    with torch.no_grad():
        o, state = fn(inputs)
    distances = {"o": float(relative_error(o, reference[0]))}
    if state is not None:
        distances["final_state"] = float(relative_error(state, reference[1]))
    return distances


def time_forward(fn, inputs, rep_ms: int) -> float:
    """The forward alone: under no_grad, or for the model's inputs under autograd, as training runs it
    (the op then keeps what its backward needs)."""
    from triton.testing import do_bench

    if inputs["use_qk_l2norm_in_kernel"]:
        x = dict(inputs, **_leaves(inputs))
        return do_bench(lambda: fn(x), warmup=max(rep_ms // 4, 10), rep=rep_ms, return_mode="median")
    with torch.no_grad():
        return do_bench(lambda: fn(inputs), warmup=max(rep_ms // 4, 10), rep=rep_ms, return_mode="median")


def time_backward(fn, inputs, rep_ms: int, forward_ms: float) -> float:
    from triton.testing import do_bench

    leaves = _leaves(inputs)
    x = dict(inputs, **leaves)
    output_grads = _output_grads_for(_differentiated(*fn(x)))

    def step():
        torch.autograd.backward(_differentiated(*fn(x)), output_grads)

    total = do_bench(step, warmup=max(rep_ms // 4, 10), rep=rep_ms, return_mode="median",
                     grad_to_none=list(leaves.values()))
    return total - forward_ms


def _median_ms(fn, rep_ms: int, **kwargs) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(rep_ms // 20, 10), rep=rep_ms, return_mode="median", **kwargs)


def compare_keep_forward(rep_ms: int):
    """Forward + backward through the public op, recomputing the forward's intermediates in the
    backward (keep_for_backward=False) against keeping all but the chunk states ("inverse") and
    keeping them all (True, the default)."""
    from flashqla import chunk_gated_delta_rule

    for heads in ((16, 64), (16, 16), (2, 8)):
        x = make_inputs(heads, [32768])
        do, dht = _output_grads_for((x["v"], x["initial_state"]))
        leaves = [x[n].detach().requires_grad_(True) for n in DIFFERENTIABLE_INPUTS]

        def step(keep):
            o, final_state = chunk_gated_delta_rule(
                *leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=x["cu_seqlens"],
                cu_seqlens_cpu=x["cu_seqlens_cpu"], backend="tilelang", keep_for_backward=keep)
            torch.autograd.backward((o, final_state), (do, dht))

        yield (f"{heads[0]}/{heads[1]} 32768",
               {"recomputed": _median_ms(lambda: step(False), rep_ms, grad_to_none=leaves),
                "inverse kept": _median_ms(lambda: step("inverse"), rep_ms, grad_to_none=leaves),
                "kept": _median_ms(lambda: step(True), rep_ms, grad_to_none=leaves)})


def compare_conv(rep_ms: int):
    """The GDN layer's causal conv + SiLU, forward + backward, at the 0.8B model's layer width (6144
    channels): torch.compile of the torch definition (what the model ran before the kernel) against
    the TileLang kernel; one document, and eight packed. Then the kernel's backward alone with its
    256-token blocks against 128 and 64 (at 8192 tokens the 256-token blocks give 384 CTAs, under three
    an SM); raises where a block size changes dx or dw by more than float32 rounding."""
    from flashqla.conv import causal_conv1d_silu, causal_conv1d_silu_torch
    from flashqla.hopper.causal_conv import BACKWARD_TOKENS, conv_backward
    from flashqla.testing import relative_error

    compiled = torch.compile(causal_conv1d_silu_torch, dynamic=True)
    for tokens, docs in ((8192, 1), (32768, 1), (32768, 8), (131072, 1)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, tokens, 6144, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        weight = torch.randn(6144, 1, 4, device="cuda", generator=gen).requires_grad_()
        dy = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
        position = torch.arange(tokens, device="cuda") % (tokens // docs)

        def step(run):
            run().backward(dy)

        variants = {"torch.compile": lambda: compiled(x, weight, position),
                    "kernel": lambda: causal_conv1d_silu(x, weight, position, backend="tilelang")}
        label = f"1x{tokens} {docs} doc{'s' if docs > 1 else ''}"
        yield (label,
               {name: _median_ms(lambda: step(run), rep_ms, grad_to_none=[x, weight]) for name, run in variants.items()})

        flat, taps, dy_flat = x.detach().view(tokens, -1), weight.detach().view(6144, -1), dy.view(tokens, -1)
        position32 = position.to(torch.int32)
        reference = conv_backward(flat, taps, position32, dy_flat)
        blocks = {}
        for block_tokens in (BACKWARD_TOKENS, 128, 64):
            for name, a, b in zip(("dx", "dw"), reference, conv_backward(flat, taps, position32, dy_flat, block_tokens)):
                # dx is the same sum at any block; dw's partial sums regroup (float32)
                bound = 0.0 if name == "dx" else 1e-5
                if not float(relative_error(b, a)) <= bound:  # also catches NaN
                    raise AssertionError(f"conv backward, {block_tokens}-token blocks: {name} moved from the kernel's")
            blocks[f"backward, {block_tokens}-token blocks"] = _median_ms(
                functools.partial(conv_backward, flat, taps, position32, dy_flat, block_tokens), rep_ms)
        yield f"{label}, backward", blocks


# The chunks' gate-free inverse at the bench's large shapes and the models' (the stage FlashQLA also runs alone).
INVERSE_SHAPES = [("16/64 1x32768", (16, 64), [32768]), ("16/64 8192x4", (16, 64), [8192] * 4),
                  ("2/8 1x32768", (2, 8), [32768]), ("2/8 1x131072", (2, 8), [131072]),
                  ("16/16 1x131072", (16, 16), [131072]), ("8/8 1x131072", (8, 8), [131072])]


def compare_inverse(rep_ms: int):
    """A~ of every chunk (flashqla/hopper/inverse.py, which makes gamma beside it) against FlashQLA's kkt_solve,
    which makes the same [T, Hv, 64] A~, on the bench inputs (normalised k, fp32 beta); FlashQLA's only where it
    is installed."""
    from flashqla.hopper.chunk_plan import chunk_bounds
    from flashqla.hopper.inverse import gamma_and_inverse

    try:
        from flash_qla.ops.gated_delta_rule.chunk.hopper.kkt_solve import kkt_solve
    except ImportError:
        kkt_solve = None
    for name, heads, seq_lens in INVERSE_SHAPES:
        x = make_inputs(heads, seq_lens)
        k, g, beta, cu = x["k"][0], x["g"][0], x["beta"][0], x["cu_seqlens"]
        bounds = chunk_bounds(cu)
        times = {"ours": _median_ms(lambda: gamma_and_inverse(k, g, beta, bounds), rep_ms)}
        if kkt_solve is not None:
            times["flashqla kkt_solve"] = _median_ms(lambda: kkt_solve(x["k"], x["beta"], cu_seqlens=x["cu_seqlens_long"]),
                                                     rep_ms)
        yield name, times


def forward_walk_on(heads: tuple[int, int], seq_lens: list[int]):
    """fused_forward's walk on the bench's inputs with the forward's own gamma, A~ and plan (needs CUDA):
    returns (run, plan), run(store_chunk_states, **keywords) calling the walk alone."""
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward
    from flashqla.hopper.fused_forward import MAX_VALUE_BLOCK, fused_forward
    from flashqla.hopper.inverse import gamma_and_inverse
    from flashqla.hopper.walk_bounds import walk_bounds

    x = make_inputs(heads, seq_lens)
    q, k, v, g, beta, cu = x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], x["cu_seqlens"]
    plan = plan_forward(cu, heads[1], 128, device_sm_count(q.device), MAX_VALUE_BLOCK,
                        host_bounds=x["cu_seqlens_cpu"].tolist())
    gamma, inverse = gamma_and_inverse(k, g, beta, plan.chunk_bounds)
    walk = walk_bounds(gamma, plan.pieces, cu, ahead=False)

    def run(store_chunk_states: bool, **keywords):
        return fused_forward(q, k, v, gamma, beta, inverse, 128 ** -0.5, x["initial_state"], cu, plan.value_block,
                             plan.pieces, walk, store_chunk_states=store_chunk_states, offsets=plan.chunk_offsets,
                             num_chunks=plan.chunk_index.shape[0], **keywords)

    return run, plan


def compare_forward_walk(rep_ms: int):
    """The forward walk (fused_forward.py) against its candidates (WALK_CANDIDATES: fused_forward's
    switches), storing nothing and everything (what the model keeps), on the forward's own gamma, A~ and
    plan. The candidates do the walk's arithmetic in another arrangement, so it raises unless every
    output (o, final state, chunk states) is bitwise the walk's."""
    keeps = {"nothing": (False,), "everything": (True,)}
    shapes = INVERSE_SHAPES + [("16/32 1x32768", (16, 32), [32768]), ("16/48 8192x4", (16, 48), [8192] * 4),
                               ("16/32 8192x4", (16, 32), [8192] * 4), ("8/24 1x32768", (8, 24), [32768]),
                               ("4/16 1x8192", (4, 16), [8192]),
                               ("16/16 ragged", (16, 16), [1000, 0, 64, 2047, 1, 129, 640])]
    for name, heads, seq_lens in shapes:
        run, plan = forward_walk_on(heads, seq_lens)
        walk_out = run(*keeps["everything"])
        for label, switches in WALK_CANDIDATES.items():
            out = run(*keeps["everything"], **switches)
            differ = [what for what, a, b in zip(("o", "final state", "chunk states"), walk_out, out)
                      if not torch.equal(a, b)]
            if differ:
                raise AssertionError(f"forward_walk {name}: {label}'s {', '.join(differ)} differ from the walk's")
        times = {}
        for keep_label, keep in keeps.items():
            times[f"walk, {keep_label}"] = _median_ms(lambda: run(*keep), rep_ms)
            for label, switches in WALK_CANDIDATES.items():
                times[f"{label}, {keep_label}"] = _median_ms(lambda: run(*keep, **switches), rep_ms)
        yield f"{name} (V block {plan.value_block})", times


def backward_operands(heads: tuple[int, int], seq_lens: list[int], like_the_model: bool = False):
    """(inputs, cu_seqlens as a list, forward.forward's leading arguments, dO, dht) on the bench's inputs (needs
    CUDA): random dO, and dht where the inputs have a final state."""
    x = make_inputs(heads, seq_lens, like_the_model=like_the_model)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"])
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(x["v"].dtype)  # o's shape and dtype
    dht = None if like_the_model else torch.randn(x["initial_state"].shape, generator=gen, device="cuda")
    return x, x["cu_seqlens_cpu"].tolist(), args, do, dht


def kept_backward_on(heads: tuple[int, int], seq_lens: list[int], like_the_model: bool):
    """backward.backward on backward_operands from the forward's kept tensors: returns run(timeline=None,
    **switches), the gradients of one call (switches: backward's keywords, e.g. norm_in_fused_walk)."""
    from flashqla.hopper.backward import backward
    from flashqla.hopper.forward import forward

    x, host, args, do, dht = backward_operands(heads, seq_lens, like_the_model)
    _, _, kept, *rstds = forward(*args, x["output_final_state"], x["cu_seqlens"], cu_seqlens_host=host,
                                 keep_for_backward=True, normalize_qk=like_the_model)
    norm = dict(zip(("q_rstd", "k_rstd"), rstds[0])) if like_the_model else {}

    def run(timeline: torch.Tensor | None = None, **switches):
        return backward(*args, x["cu_seqlens"], do, dht, cu_seqlens_host=host, kept=kept, timeline=timeline, **norm,
                        **switches)

    return run


def compare_backward_fused(rep_ms: int):
    """The backward from the forward's kept tensors (the reverse walk, backward_fused.py), with the L2 norm as the
    model calls the op ("model") and on the anchors' normalised inputs with h0 ("plain"), beside the candidate
    whose delta role has 8 registers more ("delta 176 registers", backward_fused.DELTA_HEAVY_REGISTERS), which
    raises unless its gradients are bitwise the walk's; where each value head has its own q, k head, in model mode,
    also the candidate with the norm's backward inside the walk ("norm in walk", which raises where a gradient of it
    is more than 1e-2 (relative L2) from the walk's), alone and with the register budget (bitwise it or raises). A
    form of the walk (tools/device_session.sh fused-bench:FORM) is timed against another by two such runs."""
    from flashqla.hopper.backward_fused import DELTA_HEAVY_REGISTERS
    from flashqla.testing import relative_error

    shapes = INVERSE_SHAPES + [("16/32 1x65536", (16, 32), [65536]), ("16/16 ragged", (16, 16), [1000, 0, 64, 2047, 1,
                                                                                                    129, 640] * 8)]
    labels = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    registers = dict(walk_registers=DELTA_HEAVY_REGISTERS)
    for name, heads, seq_lens in shapes:
        for mode in ("model", "plain"):
            run = kept_backward_on(heads, seq_lens, like_the_model=mode == "model")
            # the norm's place named on every variant, so that the columns mean the same whichever is backward's default
            norm = dict(norm_in_fused_walk=False) if mode == "model" else {}
            variants = {"fused": norm, "delta 176 registers": norm | registers}
            bitwise = [("fused", "delta 176 registers")]  # (the walk, its candidate)
            if mode == "model" and heads[0] == heads[1]:
                in_walk = dict(norm_in_fused_walk=True)
                variants |= {"norm in walk": in_walk, "norm in walk, 176 registers": in_walk | registers}
                bitwise.append(("norm in walk", "norm in walk, 176 registers"))
            grads = {variant: run(**switches) for variant, switches in variants.items()}
            for label, a, b in zip(labels, grads["fused"], grads.get("norm in walk", ())):
                error = float(relative_error(b, a))
                if not error <= 1e-2:  # also catches NaN
                    raise AssertionError(f"backward_fused {name} {mode}: the norm in the walk's {label} is "
                                         f"{error:.2e} from the walk's")
            for walk, candidate in bitwise:
                for label, a, b in zip(labels, grads[walk], grads[candidate]):
                    if not torch.equal(a, b):
                        raise AssertionError(f"backward_fused {name} {mode}: {candidate}'s {label} is not bitwise "
                                             f"{walk}'s")
            del grads
            yield f"{name} {mode}", {variant: _median_ms(lambda: run(**switches), rep_ms)
                                     for variant, switches in variants.items()}
            del run
            torch.cuda.empty_cache()


# Where ragged cuts change the plan (tests/flashqla/test_chunk_plan.py): the grouped layouts whose pieces leave
# the last wave part-empty, by chunk_plan's simulation (16/48 x 32768: 214 -> 196 chunk steps; 8/24: 107 -> 98)
PIECE_PLAN_SHAPES = [("16/48 1x32768", (16, 48), [32768]), ("16/48 1x8192", (16, 48), [8192]),
                     ("8/24 1x32768", (8, 24), [32768]), ("8/24 28672+4096", (8, 24), [28672, 4096])]


def compare_piece_plans(rep_ms: int):
    """The forward (no grad; and keeping what the backward reads) and the backward from its kept tensors, on the
    anchors' inputs with h0, with the plan's equal pieces and with ragged cuts (chunk_plan._piece_rows'
    candidate: pieces of S chunks and a shorter last one), on PIECE_PLAN_SHAPES. Raises where o or a gradient
    with ragged cuts is more than 1e-2 (relative L2) from the equal plan's (the pieces' truncated warm-ups differ)."""
    from flashqla.hopper.backward import backward
    from flashqla.hopper.chunk_plan import device_sm_count, plan_forward
    from flashqla.hopper.forward import forward
    from flashqla.testing import relative_error

    for name, heads, seq_lens in PIECE_PLAN_SHAPES:
        x, host, args, do, dht = backward_operands(heads, seq_lens)
        times, outputs, pieces = {}, {}, []
        for label, ragged in (("equal pieces", False), ("ragged cuts", True)):
            pieces.append(plan_forward(x["cu_seqlens"], heads[1], 128, device_sm_count("cuda"), host_bounds=host,
                                       ragged_cuts=ragged).pieces.shape[0])

            def run_forward(keep: bool, ragged=ragged):
                return forward(*args, True, x["cu_seqlens"], cu_seqlens_host=host, keep_for_backward=keep,
                               ragged_cuts=ragged)

            o, _, kept = run_forward(True)
            outputs[label] = (o, *backward(*args, x["cu_seqlens"], do, dht, cu_seqlens_host=host, kept=kept,
                                           ragged_cuts=ragged))
            times[f"{label}: forward"] = _median_ms(lambda: run_forward(False), rep_ms)
            times[f"{label}: forward keeping"] = _median_ms(lambda: run_forward(True), rep_ms)
            times[f"{label}: backward"] = _median_ms(
                lambda: backward(*args, x["cu_seqlens"], do, dht, cu_seqlens_host=host, kept=kept, ragged_cuts=ragged),
                rep_ms)
            del kept
        for label, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *outputs.values()):
            error = float(relative_error(b, a))
            if not error <= 1e-2:  # also catches NaN
                raise AssertionError(f"piece_plans {name}: ragged cuts' {label} is {error:.2e} from equal pieces'")
        del outputs
        for stage in ("forward", "forward keeping", "backward"):
            yield (f"{name} {stage} ({pieces[0]} / {pieces[1]} pieces)",
                   {label: times[f"{label}: {stage}"] for label in ("equal pieces", "ragged cuts")})
        torch.cuda.empty_cache()


# fused_forward's switches of the walk's candidates, timed by --compare forward_walk (none now: the last ones,
# Ab on warpgroup 2 from P's Gm with Ab and P stored first, became the walk; docs/kernel-notes.md)
WALK_CANDIDATES: dict[str, dict] = {}


COMPARISONS = {"keep_forward": compare_keep_forward, "conv": compare_conv, "inverse": compare_inverse,
               "forward_walk": compare_forward_walk,
               "backward_fused": compare_backward_fused, "piece_plans": compare_piece_plans}


def run_comparisons(names: list[str], rep_ms: int, json_path: str | None) -> None:
    """Each comparison's shapes, its variants' medians and each variant's speed-up over the first."""
    results = []
    for name in names:
        for shape, times in COMPARISONS[name](rep_ms):
            first = next(iter(times.values()))
            speedups = {variant: first / ms for variant, ms in times.items()}
            results.append({"comparison": name, "shape": shape, "ms": times, "speedup_over_first": speedups})
            print(f"{name} {shape}: " + ", ".join(f"{variant} {ms:.3f} ms ({speedups[variant]:.2f}x)"
                                                  for variant, ms in times.items()), flush=True)
            torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "comparisons": results}, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fwd", action="store_true", help="time the forward (default when --bwd is not given)")
    parser.add_argument("--bwd", action="store_true", help="also time the backward through autograd")
    parser.add_argument("--json", default=None, help="write all timings to this JSON file (after every shape)")
    parser.add_argument("--shapes", default="", help="comma-separated substrings; run only matching shape names")
    parser.add_argument("--baselines", default="fla,flashqla", help="comma-separated: fla, flashqla")
    parser.add_argument("--no-host-offsets", dest="host_offsets", action="store_false",
                        help="call ours and FLA without cu_seqlens_cpu (each reads cu_seqlens back per call)")
    parser.add_argument("--breakdown", action="store_true", help="also time each stage of our forward")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time per measurement, ms")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: start no shape whose expected end (slowest shape so far) is past this")
    parser.add_argument("--warm-only", action="store_true",
                        help="only make each library's first call per shape (compiles, autotuning) and print how long "
                             "it took; several such processes can fill the compile caches in parallel before a timed run")
    parser.add_argument("--model", action="store_true",
                        help="the op as the model calls it (unnormalised q, k with the in-kernel L2 norm, bf16 beta, no "
                             "initial or final state, the forward under autograd) on the model's head layouts")
    parser.add_argument("--keep", choices=sorted(KEEP_CHOICES), default="true",
                        help="our op's keep_for_backward under autograd: true (the op's default and the 128k "
                             "preset's), products (the model configs' default) or false; the baselines have none")
    parser.add_argument("--compare", nargs="?", const=",".join(COMPARISONS), default=None,
                        help=f"comma-separated, default all: {', '.join(COMPARISONS)}; times these kernel variants "
                             "side by side instead of the libraries")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flashqla.bench needs a CUDA GPU")
    if args.compare is not None:
        names = [n for n in args.compare.split(",") if n]
        unknown = [n for n in names if n not in COMPARISONS]
        if unknown:
            raise SystemExit(f"--compare {unknown}: expected names from {', '.join(COMPARISONS)}")
        run_comparisons(names, args.rep, args.json)
        return
    started = time.perf_counter()
    do_forward = args.fwd or not args.bwd
    keep = KEEP_CHOICES[args.keep]
    impls = implementations([b for b in args.baselines.split(",") if b], args.host_offsets, keep_for_backward=keep)
    wanted = [s for s in args.shapes.split(",") if s]
    candidates = MODEL_SHAPES if args.model else bench_shapes()
    shapes = [s for s in candidates if not wanted or any(w in s[0] for w in wanted)]
    if not shapes:
        raise SystemExit(f"--shapes {args.shapes!r} matches none of: {', '.join(s[0] for s in candidates)}")

    results, skipped, slowest_shape_s = [], [], 0.0
    for name, heads, seq_lens in shapes:
        elapsed = time.perf_counter() - started
        if args.time_budget is not None and results and elapsed + slowest_shape_s > args.time_budget:
            skipped.append(name)
            continue
        shape_started = time.perf_counter()
        inputs = make_inputs(heads, seq_lens, like_the_model=args.model)
        row = {"shape": name, "heads": list(heads), "seq_lens": seq_lens, "like_the_model": args.model,
               "first_call_s": {}}
        for impl_name, fn in impls.items():
            try:
                row["first_call_s"][impl_name] = first_call_s(fn, inputs)
            except Exception as error:  # e.g. a backward that refuses to run: still time the forward
                row[f"{impl_name}_first_call_error"] = f"{type(error).__name__}: {error}"[:300]
            if args.warm_only:
                continue
            try:
                forward_ms = time_forward(fn, inputs, args.rep)
                if do_forward:
                    row[f"{impl_name}_fwd_ms"] = forward_ms
                if args.bwd:
                    row[f"{impl_name}_bwd_ms"] = time_backward(fn, inputs, args.rep, forward_ms)
            except Exception as error:  # a baseline failing must not hide the others' numbers
                row[f"{impl_name}_error"] = f"{type(error).__name__}: {error}"[:300]
        if args.warm_only:
            print(format_row(row, impls), flush=True)
            continue
        if "fla" in impls and "fla_error" not in row:
            try:
                with torch.no_grad():
                    reference = impls["fla"](inputs)
                row["distance_from_fla"] = {n: distance_from(reference, fn, inputs)
                                            for n, fn in impls.items() if n != "fla" and f"{n}_error" not in row}
            except Exception as error:
                row["distance_error"] = f"{type(error).__name__}: {error}"[:300]
        if args.breakdown:
            try:
                row["ours_breakdown_ms"] = forward_breakdown(inputs, max(args.rep // 4, 20), args.model)
                if args.bwd:
                    row["ours_backward_breakdown_ms"] = backward_breakdown(inputs, max(args.rep // 4, 20), args.model)
            except Exception as error:
                row["ours_breakdown_error"] = f"{type(error).__name__}: {error}"[:300]
        row["wall_s"] = time.perf_counter() - shape_started
        slowest_shape_s = max(slowest_shape_s, row["wall_s"])
        results.append(row)
        print(format_row(row, impls), flush=True)
        del inputs
        torch.cuda.empty_cache()
        if args.json:
            write_json(args.json, results, skipped, impls, args.host_offsets, keep)

    print()
    print(format_table(results, impls, do_forward, args.bwd))
    if skipped:
        print(f"skipped for --time-budget {args.time_budget:g} s: {', '.join(skipped)}")
    if args.json:
        write_json(args.json, results, skipped, impls, args.host_offsets, keep)


def write_json(path: str, results: list[dict], skipped: list[str], impls: dict, host_offsets: bool,
               keep_for_backward: bool | str = True) -> None:
    import importlib.metadata as metadata

    versions = {}
    for package in ("torch", "triton", "tilelang", "fla-core", "flash-qla"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "versions": versions, "implementations": list(impls),
                   "host_offsets": host_offsets, "keep_for_backward": keep_for_backward, "results": results,
                   "skipped": skipped}, f, indent=1)


def format_row(row: dict, impls: dict) -> str:
    parts = [row["shape"]]
    for kind in ("fwd", "bwd"):
        ours = row.get(f"ours_{kind}_ms")
        for impl_name in impls:
            key = f"{impl_name}_{kind}_ms"
            if key in row:
                ratio = f" ({row[key] / ours:.2f}x ours)" if impl_name != "ours" and ours else ""
                parts.append(f"{impl_name} {kind} {row[key]:.3f} ms{ratio}")
    for impl_name in impls:
        if f"{impl_name}_error" in row:
            parts.append(f"{impl_name} ERROR {row[f'{impl_name}_error']}")
    if row.get("first_call_s"):
        parts.append("first call " + " ".join(f"{n}={t:.1f}s" for n, t in row["first_call_s"].items()))
    for impl_name, distance in row.get("distance_from_fla", {}).items():
        state = f" state {distance['final_state']:.1e}" if "final_state" in distance else ""
        parts.append(f"{impl_name} vs fla o {distance['o']:.1e}{state}")
    for key, label in (("ours_breakdown_ms", "stages"), ("ours_backward_breakdown_ms", "backward stages")):
        if key in row:
            parts.append(label + " " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row[key].items()))
    if "ours_breakdown_error" in row:
        parts.append(f"breakdown ERROR {row['ours_breakdown_error']}")
    return " | ".join(parts)


def format_table(results: list[dict], impls: dict, do_forward: bool, do_backward: bool) -> str:
    kinds = (["fwd"] if do_forward else []) + (["bwd"] if do_backward else [])
    lines = []
    for kind in kinds:
        header = ["shape (Hqk/Hv tokens)"] + [f"{n} {kind} ms" for n in impls]
        header += [f"{n}/ours" for n in impls if n != "ours"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for row in results:
            ours = row.get(f"ours_{kind}_ms")
            cells = [row["shape"]]
            cells += [f"{row[f'{n}_{kind}_ms']:.3f}" if f"{n}_{kind}_ms" in row else "-" for n in impls]
            for n in impls:
                if n == "ours":
                    continue
                other = row.get(f"{n}_{kind}_ms")
                cells.append(f"{other / ours:.2f}" if other and ours else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
