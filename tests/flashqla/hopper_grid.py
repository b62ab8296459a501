"""What the Hopper kernel tests (tests/flashqla/test_hopper_*.py) share: the grid of head layouts and
lengths, GPU inputs, the float64 forward and gradients they are measured against, and NaN
poisoning of free memory."""
import torch
import torch.nn.functional as F

from flashqla import reference
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


def poison_allocator():
    """Fill the caching allocator's free blocks with NaN so that unwritten outputs show."""
    free = torch.cuda.mem_get_info()[0]
    junk = torch.empty(min(free // 4, 8 << 30) // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
    del junk


def float64_gradients(inputs, do, dht):
    """(dq, dk, dv, dg, dbeta, dh0) by autograd through the float64 chunked reference."""
    names = ("q", "k", "v", "g", "beta", "initial_state")
    args = {n: x.double().requires_grad_() for n, x in inputs.items() if n in names and x is not None}
    if "initial_state" not in args:
        args["initial_state"] = torch.zeros_like(dht, dtype=torch.float64).requires_grad_()
    o, final_state = reference.chunk_gated_delta_rule_torch(
        args["q"], args["k"], args["v"], args["g"], args["beta"], initial_state=args["initial_state"],
        output_final_state=True, cu_seqlens=inputs["cu_seqlens"])
    loss = (o * do.double()).sum() + (final_state * dht.double()).sum()
    return torch.autograd.grad(loss, [args[n] for n in names])


def assert_close_to_reference(ours, ref):
    """Every gradient of `ours` within TOLERANCE (relative L2) of `ref`, in GRAD_NAMES order."""
    errors = {name: relative_error(x, r) for name, x, r in zip(GRAD_NAMES, ours, ref)}
    assert all(err <= TOLERANCE for err in errors.values()), errors
