"""What the Hopper kernel tests (tests/flashqla/test_hopper_*.py) share: the grid of head layouts and
lengths, GPU inputs, the float64 forward and gradients they are measured against, NaN poisoning of
free memory, and (for test_hopper_hard_inputs.py) the hard-input generator with errors measured per
(sequence, head). The hard-input helpers are pure torch and run on the CPU too."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flashqla import reference
from flashqla.hopper.common import CHUNK_SIZE
from flashqla.testing import relative_error

on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

TOLERANCE = 2e-2
HEAD_LAYOUTS = [(16, 64), (16, 32), (16, 16), (8, 24), (2, 8)]
HEAD_IDS = [f"{a}_{b}" for a, b in HEAD_LAYOUTS]
# Ragged: partial chunks, an empty sequence, a one-token sequence, exact multiples of 64.
RAGGED = [1000, 0, 64, 2047, 1, 129, 640]
LENGTHS = {"1x4096": [4096], "ragged": RAGGED, "1x32768": [32768]}
DECAYS = ("mixed", "strong", "still")
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(seq_lens, num_qk_heads, num_v_heads, with_initial_state=False, dtype=torch.bfloat16, seed=0,
                decay="mixed", with_output_grads=False):
    """Anchors-like packed inputs drawn on the GPU: q/k L2-normalised and v in `dtype`, float32
    g = logsigmoid(randn) / 16, beta, h0. With Hv >= 4 a quarter of the heads never decay (g = 0) and,
    by `decay`, a second quarter decays 16x faster ("mixed"), draws g down to -20 per token
    ("strong"), or is left as drawn ("still"). With `with_output_grads` returns
    `(inputs, do, dht)`, the gradients of o and of the final state drawn after the inputs."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(seq_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    q = F.normalize(randn(1, total, num_qk_heads, 128), dim=-1).to(dtype)
    k = F.normalize(randn(1, total, num_qk_heads, 128), dim=-1).to(dtype)
    v = randn(1, total, num_v_heads, 128).to(dtype)
    g = F.logsigmoid(randn(1, total, num_v_heads)) / 16
    quarter = num_v_heads // 4
    if quarter:
        g[..., :quarter] = 0.0
        if decay == "mixed":
            g[..., quarter:2 * quarter] *= 16
        elif decay == "strong":
            g[..., quarter:2 * quarter] = -20.0 * torch.rand(1, total, quarter, generator=gen, device="cuda")
    beta = torch.rand(1, total, num_v_heads, generator=gen, device="cuda").sigmoid()
    cu_seqlens = torch.tensor([0, *seq_lens], device="cuda").cumsum(0).to(torch.int32)
    h0 = randn(len(seq_lens), num_v_heads, 128, 128) if with_initial_state else None
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu_seqlens)
    if not with_output_grads:
        return inputs
    do = randn(1, total, num_v_heads, 128).to(dtype)
    dht = randn(len(seq_lens), num_v_heads, 128, 128)
    return inputs, do, dht


def make_backward_inputs(seq_lens, num_qk_heads, num_v_heads, with_initial_state, seed=0, strong_decay=False):
    """(inputs, do, dht) for the backward tests: bf16 q/k/v, float32 g/beta/h0. A quarter of the
    heads never decay (g = 0); with strong_decay another quarter draws g down to -20 per token."""
    return make_inputs(seq_lens, num_qk_heads, num_v_heads, with_initial_state, seed=seed,
                       decay="strong" if strong_decay else "still", with_output_grads=True)


def float64_reference(inputs):
    """(o, final_state) of `inputs` in float64."""
    args = {name: (x.double() if x is not None and x.is_floating_point() else x) for name, x in inputs.items()}
    # The token loop is the ground truth; for 32k tokens the chunked float64 form (checked
    # against it in tests/flashqla/test_reference.py) keeps the test quick.
    short = inputs["q"].shape[1] <= 8192
    fn = reference.recurrent_gated_delta_rule if short else reference.chunk_gated_delta_rule_torch
    return fn(args["q"], args["k"], args["v"], args["g"], args["beta"], initial_state=args["initial_state"],
              output_final_state=True, cu_seqlens=args["cu_seqlens"])


def float64_gamma(g: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """gamma of docs/gdn-math.md §2.1 in float64: g [..., T, H] summed from each chunk's start, chunks
    restarting at every sequence start ([T, H])."""
    g = g.reshape(-1, g.shape[-1]).double()
    gamma = torch.empty_like(g)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        for chunk in range(start, end, CHUNK_SIZE):
            gamma[chunk:min(chunk + CHUNK_SIZE, end)] = g[chunk:min(chunk + CHUNK_SIZE, end)].cumsum(0)
    return gamma


def assert_gamma_matches_float64(gamma: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor):
    """gamma as the kernels make it against float64_gamma: at most 64 float32 additions give ~1e-7 over the
    tensor, where a token off by one gives ~1e-2."""
    assert relative_error(gamma, float64_gamma(g, cu_seqlens)) <= 1e-6


def float64_products(inputs, scale: float = 128 ** -0.5):
    """(A~, Ab, P), [T, Hv, 64] each in float64, of the op's inputs (q, k, g, beta, cu_seqlens): the
    reference's (flashqla.reference.chunk_products), what the kernels store in bf16."""
    args = [inputs[name].double() for name in ("q", "k", "g", "beta")]
    return tuple(x[0] for x in reference.chunk_products(*args, scale, cu_seqlens=inputs["cu_seqlens"]))


# (bytes, count) of the NaN blocks poison_allocator leaves free. The caching allocator serves requests
# <= 1 MiB from a separate small pool (2 MiB segments), so small outputs (dbeta, dg, short-sequence o,
# plan tensors) never land in a large block: both pools get blocks, and several sizes so that best-fit
# requests of any size find one.
SMALL_POOL_POISON = ((1 << 20, 32), (64 << 10, 64), (4 << 10, 256), (512, 1024))
LARGE_POOL_POISON = ((128 << 20, 4), (16 << 20, 8), (2 << 20, 16))


def poison_allocator():
    """Fill the caching allocator's free memory with NaN, in both its pools, so that unwritten outputs show.

    Cached free blocks are released first, so every free block afterwards is one of the NaN blocks made
    here (or fresh memory for a request larger than all of them)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    sizes = [min(free // 4, 8 << 30)] + [size for size, count in LARGE_POOL_POISON + SMALL_POOL_POISON
                                          for _ in range(count)]
    junk = [torch.empty(size // 4, dtype=torch.float32, device="cuda").fill_(float("nan")) for size in sizes]
    torch.cuda.synchronize()
    del junk


def float64_gradients(inputs, do, dht):
    """(dq, dk, dv, dg, dbeta, dh0) by autograd through the float64 chunked reference, one qk head and
    its value heads at a time: heads never mix, so the blocks are exact, and the reference's float64
    intermediates stay a head group's (16/64 x 32768 at once needs ~78 GiB, an H100's whole memory)."""
    num_qk_heads, num_v_heads = inputs["q"].shape[2], inputs["v"].shape[2]
    group = num_v_heads // num_qk_heads
    blocks = [_float64_gradients_of_heads(inputs, do, dht, head, group) for head in range(num_qk_heads)]
    return tuple(torch.cat(parts, dim=1 if name == "dh0" else 2) for name, parts in zip(GRAD_NAMES, zip(*blocks)))


def _float64_gradients_of_heads(inputs, do, dht, qk_head: int, group: int):
    """float64_gradients of qk head `qk_head` and its `group` value heads."""
    qk, vs = slice(qk_head, qk_head + 1), slice(qk_head * group, (qk_head + 1) * group)
    args = {name: inputs[name][:, :, qk].double().requires_grad_() for name in ("q", "k")}
    args.update({name: inputs[name][:, :, vs].double().requires_grad_() for name in ("v", "g", "beta")})
    h0 = inputs.get("initial_state")
    h0 = torch.zeros_like(dht) if h0 is None else h0
    args["initial_state"] = h0[:, vs].double().requires_grad_()
    o, final_state = reference.chunk_gated_delta_rule_torch(
        args["q"], args["k"], args["v"], args["g"], args["beta"], initial_state=args["initial_state"],
        output_final_state=True, cu_seqlens=inputs["cu_seqlens"])
    loss = (o * do[:, :, vs].double()).sum() + (final_state * dht[:, vs].double()).sum()
    return torch.autograd.grad(loss, [args[n] for n in ("q", "k", "v", "g", "beta", "initial_state")])


def assert_close_to_reference(ours, ref, seq_lens=None):
    """Every gradient of `ours` within TOLERANCE (relative L2) of `ref`, in GRAD_NAMES order; with
    seq_lens (the lengths of the packed sequences) also every (sequence, head) within 2 x TOLERANCE
    (sequence_head_errors), since on the ragged grid a zeroed 1-token sequence moves the whole
    tensor's error by less than 1e-3."""
    errors = {name: relative_error(x, r) for name, x, r in zip(GRAD_NAMES, ours, ref)}
    assert all(err <= TOLERANCE for err in errors.values()), errors
    if seq_lens is not None:
        assert_slices_close(dict(zip(GRAD_NAMES, ours)), dict(zip(GRAD_NAMES, ref)), seq_lens)


def assert_slices_close(ours: dict, ref: dict, seq_lens):
    """Each output's worst (sequence, head) within 2 x TOLERANCE of ref: token-major outputs sliced by
    seq_lens, per-sequence states (STATE_OUTPUTS) by their first dim."""
    worst = {}
    for name, x in ours.items():
        slices = sequence_head_errors(x, ref[name], None if name in STATE_OUTPUTS else seq_lens)
        if not slices.worst <= 2 * TOLERANCE:
            worst[name] = f"{slices.worst:.3e} at (sequence, head) {slices.worst_index}"
    assert not worst, f"per (sequence, head) above {2 * TOLERANCE:g}: {worst}"


# ---------------------------------------------------------------------------------------------------
# Hard inputs (tests/flashqla/test_hopper_hard_inputs.py): beta over all of (0, 1), correlated keys,
# heads without decay, weakly decaying and with rare strong spikes, unnormalised q/k, ragged varlen.
# Outputs and gradients are compared as a whole and per (sequence, head).

# Per value head h, by h % 4: no decay; weak decay; no decay but g = -12 at ~1 % of the tokens (long
# memory, then a reset); the anchors' logsigmoid(randn) / 16.
DECAY_PROFILES = ("none", "weak", "spikes", "anchors")
WEAK_DECAY = -1e-3
SPIKE_DECAY, SPIKE_RATE = -12.0, 0.01
BETA_EDGE = 1e-3        # beta ~ U(BETA_EDGE, 1 - BETA_EDGE), and EDGE_FRACTION of it pinned at each end
EDGE_FRACTION = 0.02
KEY_NOISE = 0.3         # correlated keys: k = normalize(c + KEY_NOISE * unit noise), one unit c per qk head
QK_SCALE_RANGE = (0.1, 10.0)  # unnormalised q, k: unit direction times a log-uniform norm per token and head

OUTPUT_NAMES = ("o", "final_state") + GRAD_NAMES
STATE_OUTPUTS = ("final_state", "dh0")  # [N, H, K, V]; the others are token-major [1, T, H, ...]
GRAD_OF = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
# (over the whole tensor, worst (sequence, head)) relative L2 bounds. The final state's per-slice bound
# is twice its tensor bound, as for every other output.
BOUNDS = {"o": (1e-2, 2e-2), "final_state": (5e-3, 1e-2), **{name: (1e-2, 2e-2) for name in GRAD_NAMES}}
# A (sequence, head) slice's error is relative to its own reference norm, but never to less than the
# larger of SLICE_FLOOR x the norm its n entries would have at the tensor's RMS entry and one RMS entry.
# Why: slices of a 1-token sequence, the exactly-zero final state of an empty sequence without h0, a head
# decayed to nothing have references near 0, where ||x - ref|| / ||ref|| divides rounding noise by ~0
# (or is 0/0) and means nothing; the kernel's absolute error there is set by the magnitudes it combines,
# which are the tensor's. So large slices are graded on their own scale and small ones against 10 % of
# the tensor's typical scale. A slice of a few entries (dg and dbeta of a sequence shorter than ~100
# tokens) is graded against at least one typical entry: a single entry's own value lands near 0 often
# enough that bf16 storage of the states alone (tools/rounding_emulation.py, 2400 one-token slices, h0)
# put 84 dbeta and 23 dg slices above 2 x 2e-2 at 10 % of n entries (worst 1.3e-1 and 7.5e-2) and none
# at one entry. A zeroed or garbage slice still fails once its reference exceeds 0.2 % of typical
# (2 % of one entry for the short ones).
SLICE_FLOOR = 0.1
# Ours may be at most FLA_RATIO x FLA's error, errors below one rounding of the exact answer to the
# inputs' dtype counted as that rounding: both libraries take bf16 inputs and bf16 tensor-core
# operands, so differences under that level rank nothing.
FLA_RATIO = 1.5


@dataclass(frozen=True)
class HardCase:
    name: str
    heads: tuple[int, int]            # (Hqk, Hv)
    seq_lens: tuple[int, ...]
    with_initial_state: bool
    correlated_keys: bool = False
    unnormalised_qk: bool = False     # q, k at random norms, normalised by the op (use_qk_l2norm_in_kernel)
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0


def make_hard_inputs(case: HardCase, device="cuda", head_dim: int = 128):
    """(inputs, do, dht) for `case`: the op's keyword arguments (q, k, v in case.dtype; float32 g, beta,
    h0; int32 cu_seqlens; use_qk_l2norm_in_kernel), and random cotangents of o (case.dtype) and of the
    final state (float32)."""
    gen = torch.Generator(device=device).manual_seed(case.seed)
    num_qk_heads, num_v_heads = case.heads
    total, num_seqs = sum(case.seq_lens), len(case.seq_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device, dtype=torch.float32)

    def unit(*shape):
        return F.normalize(randn(*shape), dim=-1)

    q = unit(1, total, num_qk_heads, head_dim)
    if case.correlated_keys:
        common = unit(1, 1, num_qk_heads, head_dim)
        k = F.normalize(common + KEY_NOISE * unit(1, total, num_qk_heads, head_dim), dim=-1)
    else:
        k = unit(1, total, num_qk_heads, head_dim)
    if case.unnormalised_qk:
        low, high = map(math.log, QK_SCALE_RANGE)
        q = q * (low + (high - low) * rand(1, total, num_qk_heads, 1)).exp()
        k = k * (low + (high - low) * rand(1, total, num_qk_heads, 1)).exp()
    v = randn(1, total, num_v_heads, head_dim)

    profile = torch.arange(num_v_heads, device=device) % len(DECAY_PROFILES)
    anchors = F.logsigmoid(randn(1, total, num_v_heads)) / 16
    spikes = torch.where(rand(1, total, num_v_heads) < SPIKE_RATE, SPIKE_DECAY, 0.0)
    g = torch.where(profile == DECAY_PROFILES.index("weak"), WEAK_DECAY, torch.zeros_like(anchors))
    g = torch.where(profile == DECAY_PROFILES.index("spikes"), spikes, g)
    g = torch.where(profile == DECAY_PROFILES.index("anchors"), anchors, g)

    beta = BETA_EDGE + (1 - 2 * BETA_EDGE) * rand(1, total, num_v_heads)
    edge = rand(1, total, num_v_heads)
    beta = torch.where(edge < EDGE_FRACTION, BETA_EDGE, beta)
    beta = torch.where(edge > 1 - EDGE_FRACTION, 1 - BETA_EDGE, beta)

    h0 = randn(num_seqs, num_v_heads, head_dim, head_dim) if case.with_initial_state else None
    cu_seqlens = torch.tensor([0, *case.seq_lens], device=device).cumsum(0).to(torch.int32)
    inputs = dict(q=q.to(case.dtype), k=k.to(case.dtype), v=v.to(case.dtype), g=g, beta=beta, initial_state=h0,
                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=case.unnormalised_qk)
    do = randn(1, total, num_v_heads, head_dim).to(case.dtype)
    dht = randn(num_seqs, num_v_heads, head_dim, head_dim)
    return inputs, do, dht


def op_outputs(op, inputs, do, dht, dtype=None, before_kernels=None) -> dict:
    """{o, final_state, dq, dk, dv, dg, dbeta[, dh0]} of `op` (the public op's signature) on `inputs`:
    the gradients of <o, do> + <final_state, dht> by autograd, w.r.t. the inputs cast to `dtype` (all
    floating inputs when given, e.g. float64 for the reference). `before_kernels` runs before the forward
    and again before the backward (NaN poisoning)."""
    differentiable = [n for n in GRAD_OF if inputs[n] is not None]
    leaves = {n: (inputs[n] if dtype is None else inputs[n].to(dtype)).detach().clone().requires_grad_()
              for n in differentiable}
    if before_kernels is not None:
        before_kernels()
    o, final_state = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                        initial_state=leaves.get("initial_state"), output_final_state=True,
                        use_qk_l2norm_in_kernel=inputs["use_qk_l2norm_in_kernel"], cu_seqlens=inputs["cu_seqlens"])
    if before_kernels is not None:
        before_kernels()
    grads = torch.autograd.grad((o, final_state), list(leaves.values()),
                                grad_outputs=(do.to(o.dtype), dht.to(final_state.dtype)))
    return {"o": o.detach(), "final_state": final_state.detach(),
            **{GRAD_OF[n]: grad for n, grad in zip(differentiable, grads)}}


class SliceErrors(NamedTuple):
    errors: torch.Tensor    # [N, H] float64 relative L2 per (sequence, head); NaN for an empty slice
    worst: float            # the largest of them (inf where a slice holds NaN/Inf)
    worst_index: tuple[int, int] | None


def _slice_sums(x: torch.Tensor, seq_lens) -> torch.Tensor:
    """Sums of x per (sequence, head): [N, H]. Token-major [1, T, H, ...] with seq_lens, or [N, H, ...]."""
    if seq_lens is None:
        return x.reshape(x.shape[0], x.shape[1], -1).sum(-1)
    per_token = x.reshape(x.shape[1], x.shape[2], -1).sum(-1)
    lengths = torch.tensor(list(seq_lens), device=x.device)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
    return per_token.new_zeros(len(lengths), per_token.shape[1]).index_add_(0, sequence, per_token)


def sequence_head_errors(x: torch.Tensor, ref: torch.Tensor, seq_lens=None, floor: float = SLICE_FLOOR) -> SliceErrors:
    """Relative L2 error of x against ref per (sequence, head), with the floor of SLICE_FLOOR's comment.

    x, ref: token-major `[1, T, H, ...]` with seq_lens (the sequences' lengths, summing to T), or
    per-sequence states `[N, H, ...]` without."""
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    if x.shape != ref.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but ref has {tuple(ref.shape)}")
    finite = torch.isfinite(x)
    error2 = _slice_sums(torch.where(finite, x - ref, 0.0).square(), seq_lens)
    ref2 = _slice_sums(ref.square(), seq_lens)
    count = _slice_sums(torch.ones_like(ref), seq_lens)
    non_finite = _slice_sums((~finite).double(), seq_lens)
    mean_square = ref2.sum() / count.sum().clamp_min(1)
    typical = torch.maximum(floor * count.sqrt(), torch.ones_like(count)) * mean_square.sqrt()
    denominator = torch.maximum(ref2.sqrt(), typical).clamp_min(1e-300)
    errors = error2.sqrt() / denominator
    errors = torch.where(non_finite > 0, math.inf, errors)
    errors = torch.where(count == 0, math.nan, errors)
    if (count == 0).all():
        return SliceErrors(errors.cpu(), 0.0, None)
    flat = torch.where(errors.isnan(), -1.0, errors)
    index = int(flat.argmax())
    worst_index = divmod(index, errors.shape[1])
    return SliceErrors(errors.cpu(), float(flat.flatten()[index]), worst_index)


class OutputError(NamedTuple):
    tensor: float           # relative L2 over the whole tensor (inf with NaN/Inf)
    slices: SliceErrors
    finite: bool
    rounding: float         # relative L2 of the reference itself rounded to the inputs' dtype


def compare_outputs(ours: dict, ref: dict, seq_lens, dtype=torch.bfloat16) -> dict:
    """{name: OutputError} for every output of `ref`; `ours` must have the same names."""
    if set(ours) != set(ref):
        raise ValueError(f"outputs differ: ours has {sorted(ours)}, the reference {sorted(ref)}")
    return {name: OutputError(relative_error(ours[name], ref[name]),
                              sequence_head_errors(ours[name], ref[name], None if name in STATE_OUTPUTS else seq_lens),
                              bool(torch.isfinite(ours[name]).all()),
                              relative_error(ref[name].to(dtype), ref[name]))
            for name in OUTPUT_NAMES if name in ref}


def bound_failures(errors: dict) -> list[str]:
    """What breaks BOUNDS or holds NaN/Inf, one line each (empty when all is within budget)."""
    failures = []
    for name, err in errors.items():
        tensor_bound, slice_bound = BOUNDS[name]
        if not err.finite:
            failures.append(f"{name}: NaN/Inf")
            continue
        if not err.tensor <= tensor_bound:
            failures.append(f"{name}: relative L2 {err.tensor:.3e} > {tensor_bound:g} over the tensor")
        if not err.slices.worst <= slice_bound:
            failures.append(f"{name}: relative L2 {err.slices.worst:.3e} > {slice_bound:g} at (sequence, head) "
                            f"{err.slices.worst_index}")
    return failures


def fla_failures(ours: dict, fla: dict, ratio: float = FLA_RATIO) -> list[str]:
    """Where ours is more than `ratio` x FLA's error (whole tensor, and worst slice against worst slice),
    FLA's error taken as at least the rounding of the reference to the inputs' dtype."""
    failures = []
    for name, err in ours.items():
        if name not in fla:
            continue
        for what, mine, theirs in (("tensor", err.tensor, fla[name].tensor),
                                   ("worst (sequence, head)", err.slices.worst, fla[name].slices.worst)):
            if not mine <= ratio * max(theirs, err.rounding):
                failures.append(f"{name}: {what} error {mine:.3e} > {ratio:g} x FLA's {theirs:.3e} "
                                f"(floor {err.rounding:.1e})")
    return failures


def differing_outputs(first: dict, second: dict) -> list[str]:
    """Names of the outputs that are not bitwise equal between two runs."""
    return [name for name in first if not torch.equal(first[name], second[name])]


def error_table(title: str, errors: dict, fla: dict | None = None) -> str:
    """A compact table: per output the whole-tensor and the worst (sequence, head) error and its index,
    the bounds, and FLA's errors beside them when given."""
    head = f"{'output':<12}{'tensor':>10}{'worst':>10}  {'(seq, head)':<12}{'bounds':>14}"
    if fla is not None:
        head += f"  |{'fla tensor':>11}{'fla worst':>10}  (seq, head)"
    lines = [title, head]
    for name, err in errors.items():
        index = "-" if err.slices.worst_index is None else str(err.slices.worst_index)
        line = (f"{name:<12}{err.tensor:>10.2e}{err.slices.worst:>10.2e}  {index:<12}"
                f"{'%g / %g' % BOUNDS[name]:>14}")
        if fla is not None and name in fla:
            theirs = fla[name]
            line += f"  |{theirs.tensor:>11.2e}{theirs.slices.worst:>10.2e}  {theirs.slices.worst_index}"
        lines.append(line)
    return "\n".join(lines)
