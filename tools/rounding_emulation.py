"""How much of the kernels' error against float64 bf16 rounding alone explains, on the hard inputs.

    python tools/rounding_emulation.py CASE[,CASE...] POINTS [POINTS ...]

CASE names a case of tests/flashqla/test_hopper_hard_inputs.py; each POINTS is a '+'-joined set of
where the kernels hold a bf16 value (forward: state, w, delta, a_tilde, ab, p, qk) or a bf16 gradient
(grad_state, grad_new_state, grad_w, grad_delta), or '' for none. For each case and set the chunked
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


def _round_forward(x: torch.Tensor) -> torch.Tensor:
    return x + (x.to(torch.bfloat16).to(x.dtype) - x).detach()


class _RoundGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16).to(grad.dtype)


def emulated_op(points: set[str]):
    """An op with the public signature: the chunked form in float64 with bf16 at `points`."""
    unknown = points - set(FORWARD_POINTS) - set(GRADIENT_POINTS)
    if unknown:
        raise ValueError(f"points {sorted(unknown)}: expected some of {FORWARD_POINTS + GRADIENT_POINTS}")

    def at(name, x):
        if name in points:
            x = _round_forward(x)
        if f"grad_{name}" in points:
            x = _RoundGradient.apply(x)
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
        if "a_tilde" in points:  # Ab from the bf16 A~ the inverse kernel stores
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


def errors_for(case, points: set[str]) -> dict:
    """compare_outputs of the emulated op against the float64 reference on `case`, on the CPU."""
    inputs, do, dht = make_hard_inputs(case, device="cpu")
    exact = op_outputs(reference.chunk_gated_delta_rule_torch, inputs, do, dht, dtype=torch.float64)
    ours = op_outputs(emulated_op(points), inputs, do, dht, dtype=torch.float64)
    return compare_outputs(ours, exact, case.seq_lens, case.dtype)


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
        for joined in args.points:
            points = set(filter(None, joined.split("+")))
            errors = errors_for(by_name[name], points)
            cells = " ".join(f"{output} {err.tensor:.1e}/{err.slices.worst:.1e}@{err.slices.worst_index}"
                             for output, err in errors.items())
            print(f"{name} [{joined or 'none'}]: {cells}", flush=True)


if __name__ == "__main__":
    main()
