"""How much of the kernels' error against float64 bf16 rounding alone explains, on the hard inputs.

    python tools/rounding_emulation.py CASE[,CASE...] POINTS [POINTS ...]

CASE names a case of tests/flashqla/test_hopper_hard_inputs.py; each POINTS is a '+'-joined set of
where the kernels hold a bf16 value (forward: state, w, delta, a_tilde, ab, p, qk) or a bf16 gradient
(grad_state, grad_new_state, grad_w, grad_delta), each with ':tf32' to round to tf32 instead, or ''
for none. For each case and set the chunked
form runs in float64 on the CPU in the kernels' arrangement (W = V - D (K S0), Delta = Ab W, as in
fused_forward.py), with those values rounded to bf16 (the gradient passes straight through a forward
rounding; a gradient rounding rounds what flows back), and prints the errors against the float64
reference as test_hopper_hard_inputs.py measures them: over the tensor / worst (sequence, head).

What it does not model: the backward kernels' own rounding points beyond these (dAb, dA~, Ag in
bf16 and the order of their sums), so it bounds from below what a kernel with these bf16 operands
reaches. docs/device-runs.md (nineteenth session) has what it found.
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "flashqla")]

from flashqla import reference  # noqa: E402
from hopper_grid import compare_outputs, make_hard_inputs, op_outputs  # noqa: E402

FORWARD_POINTS = ("state", "w", "delta", "a_tilde", "ab", "p", "qk")
GRADIENT_POINTS = ("grad_state", "grad_new_state", "grad_w", "grad_delta")


def _rounded(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to bf16 or to tf32 (10 mantissa bits, what a tf32 tensor-core operand keeps), in x's dtype."""
    if fmt == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    bits = x.to(torch.float32).view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


class _RoundGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt):
        ctx.fmt = fmt
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _rounded(grad, ctx.fmt), None


def emulated_op(points: set[str]):
    """An op with the public signature: the chunked form in float64 rounded at `points` (a name, or
    name:tf32 for tf32 instead of bf16)."""
    formats = dict(p.split(":", 1) if ":" in p else (p, "bf16") for p in points)
    unknown = {p for p, fmt in formats.items() if p not in FORWARD_POINTS + GRADIENT_POINTS or fmt not in ("bf16", "tf32")}
    if unknown:
        raise ValueError(f"points {sorted(unknown)}: expected some of {FORWARD_POINTS + GRADIENT_POINTS}, "
                         "each as it is (bf16) or with ':tf32'")

    def at(name, x):
        if name in formats:
            x = x + (_rounded(x, formats[name]) - x).detach()  # rounded value, gradient straight through
        if f"grad_{name}" in formats:
            x = _RoundGradient.apply(x, formats[f"grad_{name}"])
        return x

    def op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        batch, length, _, head_dim = q.shape
        num_v_heads, value_dim = v.shape[2], v.shape[3]
        scale = head_dim ** -0.5 if scale is None else scale
        dtype = torch.float64
        if use_qk_l2norm_in_kernel:
            q, k = (at("qk", reference.l2_normalize(x.to(dtype))) for x in (q, k))
        spans = reference._sequences(cu_seqlens, batch, length)
        num_chunks = reference._chunk_count(spans)

        def chunked(x):
            return reference._chunked(x.to(dtype), spans, num_chunks)

        q_c, k_c = chunked(reference._expand_groups(q, num_v_heads)), chunked(reference._expand_groups(k, num_v_heads))
        v_c, g_c, beta_c = chunked(v), chunked(g), chunked(beta)
        gamma, inverse, gated_inverse, scores = reference._chunk_matrices(q_c, k_c, g_c, beta_c)
        if "a_tilde" in formats:  # Ab from the A~ the inverse kernel stores
            stored = at("a_tilde", inverse)
            gated_inverse = torch.where(inverse != 0, gated_inverse * stored / torch.where(inverse != 0, inverse, 1), 0)
        gated_inverse, scores = at("ab", gated_inverse), at("p", scores)
        d = gamma.exp()[..., None]
        tail = ((gamma[..., -1:] - gamma).exp()[..., None] * k_c).transpose(-1, -2)
        chunk_decay = gamma[..., -1].exp()[..., None, None]
        state = (q.new_zeros(len(spans), num_v_heads, head_dim, value_dim, dtype=dtype)
                 if initial_state is None else initial_state.to(dtype))
        outs = []
        for n in range(num_chunks):
            entering = at("state", state)
            w = at("w", v_c[:, :, n] - d[:, :, n] * (k_c[:, :, n] @ entering))
            delta = at("delta", gated_inverse[:, :, n] @ w)
            outs.append(scale * ((d[:, :, n] * q_c[:, :, n]) @ entering + scores[:, :, n] @ delta))
            state = at("new_state", chunk_decay[:, :, n] * state + tail[:, :, n] @ delta)
        o = reference._unchunked(torch.stack(outs, dim=2), spans, length, cu_seqlens is not None)
        return o.to(v.dtype), (state if output_final_state else None)

    return op


def errors_for(case, point_sets: list[set[str]]) -> list[dict]:
    """compare_outputs of the emulated op against the float64 reference on `case`, on the CPU, for each
    set of points (one float64 graph alive at a time: the 16/32-head ragged case needs ~12 GB)."""
    inputs, do, dht = make_hard_inputs(case, device="cpu")
    exact = op_outputs(reference.chunk_gated_delta_rule_torch, inputs, do, dht, dtype=torch.float64)
    results = []
    for points in point_sets:
        ours = op_outputs(emulated_op(points), inputs, do, dht, dtype=torch.float64)
        results.append(compare_outputs(ours, exact, case.seq_lens, case.dtype))
        del ours
    return results


def main(argv=None) -> None:
    from test_hopper_hard_inputs import CASES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", help="comma-separated names from test_hopper_hard_inputs.CASES")
    parser.add_argument("points", nargs="+", help="'+'-joined rounding points per run ('' for none)")
    args = parser.parse_args(argv)
    by_name = {case.name: case for case in CASES}
    for name in args.cases.split(","):
        if name not in by_name:
            raise SystemExit(f"case {name!r}: expected one of {sorted(by_name)}")
        point_sets = [set(filter(None, joined.split("+"))) for joined in args.points]
        for joined, errors in zip(args.points, errors_for(by_name[name], point_sets)):
            cells = " ".join(f"{output} {err.tensor:.1e}/{err.slices.worst:.1e}@{err.slices.worst_index}"
                             for output, err in errors.items())
            print(f"{name} [{joined or 'none'}]: {cells}", flush=True)


if __name__ == "__main__":
    main()
