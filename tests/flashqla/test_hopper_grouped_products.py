"""The grouped products kernel (flashqla/hopper/grouped_products.py, the default wherever Hv / Hqk <= 8)
against float64 and against the per-value-head kernel of gated_products.py (kept for larger groups).

The GPU tests check every output on the forward grid (run with -s to see the errors of both kernels;
their times: `python -m flashqla.bench --compare grouped_products`). The CPU tests check the solve
recipe (register column solves + block iteration, tf32 products) in torch and audit the generated CUDA.
"""
import pytest
import torch
import torch.nn.functional as F

from flashqla.testing import relative_error
from hopper_grid import (HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, TOLERANCE, float64_reference, make_inputs,
                         on_hopper, poison_allocator)

requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")

# Both kernels store bf16 (relative rounding 2^-9); their products must sit well inside the forward's budget.
PRODUCTS_TOLERANCE = 1e-2


def _truncate_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """What a tf32 mma reads from fp32 bits: the low 13 mantissa bits dropped."""
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def test_block_iteration_recipe_inverts_exactly_and_within_tf32_budget():
    """Y <- D - N Y from Y = D, N = D StrictBlockLower(L), reaches (I + L)^-1 in _ITERATIONS steps."""
    from flashqla.hopper.grouped_products import _BLOCK, _ITERATIONS

    gen = torch.Generator().manual_seed(0)
    size = 64
    block_of = torch.arange(size) // _BLOCK
    same_block = block_of[:, None] == block_of[None, :]
    below_block = block_of[:, None] > block_of[None, :]
    for correlation in (0.0, 0.95):
        shared = torch.randn(1, 128, generator=gen, dtype=torch.float64)
        keys = F.normalize(correlation * shared + (1 - correlation) * torch.randn(size, 128, generator=gen,
                                                                                   dtype=torch.float64), dim=-1)
        beta = torch.rand(size, generator=gen, dtype=torch.float64)
        lower = torch.tril(beta[:, None] * (keys @ keys.T), -1)
        exact = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + lower)
        diag_inverse = torch.where(same_block, exact, 0.0)  # the diagonal blocks of the inverse
        for tf32 in (False, True):
            cast = _truncate_to_tf32 if tf32 else (lambda x: x)
            n = torch.where(below_block, cast(diag_inverse) @ cast(lower), 0.0).to(lower.dtype)
            y = diag_inverse.clone()
            for _ in range(_ITERATIONS):
                y = diag_inverse - (cast(n) @ cast(y)).to(lower.dtype)
            error = relative_error(y, exact)
            assert error <= (2e-3 if tf32 else 1e-12), (correlation, tf32, error)


def _blocks_opened_by(source: str, opening: str) -> list[str]:
    """Bodies of every `opening {...}` block of the generated CUDA (brace matched)."""
    bodies = []
    for start in [i for i in range(len(source)) if source.startswith(opening, i)]:
        depth, i = 0, source.index("{", start)
        for end in range(i, len(source)):
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            if depth == 0:
                bodies.append(source[i:end + 1])
                break
    return bodies


def test_grouped_products_cuda_has_no_producer_and_safe_barriers():
    """Audit of the generated CUDA, repeated on every TileLang version: no asynchronous producer
    (mbarriers/TMA) to race with; no barrier inside the per-thread column solve (only 64 threads
    reach it: a deadlock); no barrier at the top of an element loop (one per element: TileLang adds
    them when a loop reads a shared buffer indexed by a run-time value and writes another)."""
    import shutil

    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to build the sm_90a kernel")
    import re

    from flashqla.hopper.grouped_products import MIN_BLOCKS_PER_SM, compile_grouped_products

    source = compile_grouped_products().get_kernel_source()
    assert f"__launch_bounds__(128, {MIN_BLOCKS_PER_SM})" in source
    assert "mbarrier" not in source and "tma_load" not in source
    column_solves = _blocks_opened_by(source, "if (((int)threadIdx.x) < 64)")
    assert len(column_solves) >= 2 and not any("__syncthreads" in body for body in column_solves)
    assert not re.search(r"for \(int [^)]*\) \{\s*__syncthreads\(\);", source)


def test_grouped_products_reject_groups_over_the_limit():
    from flashqla.hopper.gated_products import gated_products
    from flashqla.hopper.grouped_products import MAX_GROUP_SIZE

    num_v_heads = 2 * MAX_GROUP_SIZE
    q = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    gamma = beta = torch.zeros(64, num_v_heads)
    chunk_index = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"got Hv={num_v_heads}, Hqk=1"):
        gated_products(q, q, gamma, beta, 1.0, torch.tensor([0, 64], dtype=torch.int32), chunk_index, grouped=True)


def products_inputs(inputs):
    """The flattened arguments of gated_products.gated_products, as forward.forward builds them."""
    from flashqla.hopper.chunk_plan import chunk_indices
    from flashqla.hopper.cumsum import chunk_local_cumsum

    _, total, num_qk_heads, head_dim = inputs["q"].shape
    num_v_heads = inputs["v"].shape[2]
    cu_seqlens = inputs["cu_seqlens"]
    chunk_index = chunk_indices(cu_seqlens)
    gamma = chunk_local_cumsum(inputs["g"], cu_seqlens, chunk_index=chunk_index).view(total, num_v_heads)
    return dict(q=inputs["q"].reshape(total, num_qk_heads, head_dim).contiguous(),
                k=inputs["k"].reshape(total, num_qk_heads, head_dim).contiguous(),
                gamma=gamma.contiguous(), beta=inputs["beta"].reshape(total, num_v_heads).contiguous(),
                scale=head_dim ** -0.5, cu_seqlens=cu_seqlens, chunk_index=chunk_index)


def run_products(args, grouped):
    from flashqla.hopper.gated_products import gated_products

    poison_allocator()
    return gated_products(args["q"], args["k"], args["gamma"], args["beta"], args["scale"], args["cu_seqlens"],
                          args["chunk_index"], grouped=grouped)[:2]  # (gated_inverse, scores)


def float64_products(args):
    """(gated_inverse, scores) [T, Hv, 64] in float64, chunk by chunk of every sequence."""
    q, k, gamma, beta = (args[name].double() for name in ("q", "k", "gamma", "beta"))
    total, num_v_heads = gamma.shape
    head_of = torch.arange(num_v_heads, device=q.device) // (num_v_heads // q.shape[1])
    gated_inverse = torch.zeros(total, num_v_heads, 64, dtype=torch.float64, device=q.device)
    scores = torch.zeros_like(gated_inverse)
    bounds = args["cu_seqlens"].tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length == 0:
            continue
        chunks = -(-length // 64)

        def chunked(x):  # [length, H, ...] -> [chunks, H, 64, ...], zero padded
            padded = torch.zeros(chunks * 64, *x.shape[1:], dtype=x.dtype, device=x.device)
            padded[:length] = x[start:end]
            return padded.view(chunks, 64, *x.shape[1:]).transpose(1, 2)

        qc, kc = chunked(q[:, head_of]), chunked(k[:, head_of])
        gc, bc = chunked(gamma), chunked(beta)
        eye = torch.eye(64, dtype=torch.float64, device=q.device)
        lower = torch.tril(bc[..., :, None] * (kc @ kc.transpose(-1, -2)), -1)
        inverse = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
        causal = torch.ones(64, 64, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal, gc[..., :, None] - gc[..., None, :], float("-inf")).exp()
        ab = decay * inverse * bc[..., None, :]
        p = args["scale"] * decay * torch.tril(qc @ kc.transpose(-1, -2))
        gated_inverse[start:end] = ab.transpose(1, 2).reshape(chunks * 64, num_v_heads, 64)[:length]
        scores[start:end] = p.transpose(1, 2).reshape(chunks * 64, num_v_heads, 64)[:length]
    return gated_inverse, scores


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_grouped_products_match_float64_and_the_per_head_kernel(heads, lengths):
    args = products_inputs(make_inputs(LENGTHS[lengths], *heads, seed=heads[1] * 10 + list(LENGTHS).index(lengths)))
    per_head = run_products(args, grouped=False)
    grouped = run_products(args, grouped=True)
    torch.cuda.synchronize()
    exact = float64_products(args)
    for name, got, was, ref in zip(("gated_inverse", "scores"), grouped, per_head, exact):
        assert got.shape == was.shape and got.dtype == was.dtype
        # Every token row belongs to a chunk, so a NaN left here is a row the grouped kernel never wrote.
        assert torch.isfinite(got).all(), f"{name}: NaN/Inf (unwritten rows?)"
        err_grouped, err_per_head = relative_error(got, ref), relative_error(was, ref)
        print(f"\n{heads} {lengths} {name}: relative L2 to float64 grouped {err_grouped:.2e}, "
              f"per-head {err_per_head:.2e}, grouped vs per-head {relative_error(got, was):.2e}")
        assert err_grouped <= PRODUCTS_TOLERANCE, f"{name}: grouped error {err_grouped:.3e}"
        assert err_grouped <= 2 * err_per_head + 1e-3, f"{name}: {err_grouped:.3e} vs per-head {err_per_head:.3e}"


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("dtype,beta_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp16", "bf16_beta"])
def test_grouped_products_other_dtypes(dtype, beta_dtype):
    """float16 q/k, and beta handed over in bf16 (the api passes bf16/fp16 beta through)."""
    args = products_inputs(make_inputs([777, 1536], 4, 16, seed=3))
    args["q"], args["k"], args["beta"] = args["q"].to(dtype), args["k"].to(dtype), args["beta"].to(beta_dtype)
    per_head = run_products(args, grouped=False)
    grouped = run_products(args, grouped=True)
    exact = float64_products(args)
    for got, was, ref in zip(grouped, per_head, exact):
        assert got.dtype == dtype and torch.isfinite(got).all()
        err_grouped, err_per_head = relative_error(got, ref), relative_error(was, ref)
        assert err_grouped <= PRODUCTS_TOLERANCE, err_grouped
        assert err_grouped <= 2 * err_per_head + 1e-3, (err_grouped, err_per_head)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads", [(16, 64), (8, 24), (2, 8)], ids=["16_64", "8_24", "2_8"])
def test_grouped_products_are_bitwise_deterministic(heads):
    args = products_inputs(make_inputs(RAGGED + [4096], *heads, seed=7))
    first = run_products(args, grouped=True)
    second = run_products(args, grouped=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_forward_with_grouped_products_matches_float64_reference(monkeypatch, heads, lengths, with_initial_state):
    """The whole Hopper forward, which takes the grouped products kernel by default."""
    from flashqla.hopper import gated_products
    from flashqla.hopper.forward import forward

    calls = []
    compile_grouped = gated_products.compile_grouped_products

    def counting_compile(*args, **kwargs):
        calls.append(True)
        return compile_grouped(*args, **kwargs)

    monkeypatch.setattr(gated_products, "compile_grouped_products", counting_compile)
    seed = heads[1] * 10 + list(LENGTHS).index(lengths)
    inputs = make_inputs(LENGTHS[lengths], *heads, with_initial_state, seed=seed)
    poison_allocator()
    o, final_state = forward(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None,
                             inputs["initial_state"], True, inputs["cu_seqlens"])
    torch.cuda.synchronize()
    assert calls, "forward did not run the grouped products kernel (the default when Hv / Hqk <= 8)"
    assert torch.isfinite(o).all() and torch.isfinite(final_state).all()
    ref_o, ref_state = float64_reference(inputs)
    err_o, err_state = relative_error(o, ref_o), relative_error(final_state, ref_state)
    assert err_o <= TOLERANCE, f"o relative L2 error {err_o:.3e}"
    assert err_state <= TOLERANCE, f"final state relative L2 error {err_state:.3e}"
