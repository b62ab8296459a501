"""The grouped inverse kernel (flashqla/hopper/grouped_inverse.py, the forward's wherever Hv / Hqk <= 8)
against float64 and against the per-value-head kernel of inverse.py (for larger groups).

The GPU tests check A~ on the forward grid (run with -s to see the errors of both kernels). The CPU
tests check the solve recipe (register column solves + block iteration, tf32 products) in torch and
audit the generated CUDA.
"""
import pytest
import torch
import torch.nn.functional as F

from flashqla.testing import relative_error
from hopper_grid import HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, float64_products, make_inputs, on_hopper, poison_allocator

requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")

# Both kernels store bf16 (relative rounding 2^-9); A~ must sit well inside the forward's budget.
INVERSE_TOLERANCE = 1e-2


def _truncate_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """What a tf32 mma reads from fp32 bits: the low 13 mantissa bits dropped."""
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def test_block_iteration_recipe_inverts_exactly_and_within_tf32_budget():
    """Y <- D - N Y from Y = D, N = D StrictBlockLower(L), reaches (I + L)^-1 in _ITERATIONS steps."""
    from flashqla.hopper.grouped_inverse import _BLOCK, _ITERATIONS

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


def test_grouped_inverse_cuda_has_no_producer_and_safe_barriers():
    """Audit of the generated CUDA, repeated on every TileLang version: no asynchronous producer
    (mbarriers/TMA) to race with; no barrier inside the per-thread column solve (only 64 threads
    reach it: a deadlock); no barrier at the top of an element loop (one per element: TileLang adds
    them when a loop reads a shared buffer indexed by a run-time value and writes another)."""
    import shutil

    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to build the sm_90a kernel")
    import re

    from flashqla.hopper.grouped_inverse import MIN_BLOCKS_PER_SM, compile_grouped_inverse

    source = compile_grouped_inverse().get_kernel_source()
    assert f"__launch_bounds__(128, {MIN_BLOCKS_PER_SM})" in source
    assert "mbarrier" not in source and "tma_load" not in source
    column_solves = _blocks_opened_by(source, "if (((int)threadIdx.x) < 64)")
    assert len(column_solves) >= 2 and not any("__syncthreads" in body for body in column_solves)
    assert not re.search(r"for \(int [^)]*\) \{\s*__syncthreads\(\);", source)


def test_grouped_inverse_rejects_groups_over_the_limit():
    from flashqla.hopper.grouped_inverse import MAX_GROUP_SIZE, grouped_inverse

    num_v_heads = 2 * MAX_GROUP_SIZE
    k = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    beta = torch.zeros(64, num_v_heads)
    chunk_index = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"got Hv={num_v_heads}, Hqk=1"):
        grouped_inverse(k, beta, torch.tensor([0, 64], dtype=torch.int32), chunk_index)


def inverse_inputs(inputs):
    """The flattened k and beta of grouped_inverse, with cu_seqlens and the chunk index."""
    from flashqla.hopper.chunk_plan import chunk_indices

    _, total, num_qk_heads, head_dim = inputs["k"].shape
    num_v_heads = inputs["v"].shape[2]
    return dict(k=inputs["k"].reshape(total, num_qk_heads, head_dim).contiguous(),
                beta=inputs["beta"].reshape(total, num_v_heads).contiguous(), cu_seqlens=inputs["cu_seqlens"],
                chunk_index=chunk_indices(inputs["cu_seqlens"]))


def run_inverses(args):
    """(grouped kernel, per-value-head kernel of inverse.py), each [T, Hv, 64]."""
    from flashqla.hopper.grouped_inverse import grouped_inverse
    from flashqla.hopper.inverse import gate_free_inverse

    poison_allocator()
    grouped = grouped_inverse(args["k"], args["beta"], args["cu_seqlens"], args["chunk_index"])
    poison_allocator()
    per_head = gate_free_inverse(args["k"][None], args["beta"][None], args["cu_seqlens"], args["chunk_index"])
    return grouped, per_head.view(grouped.shape)


def exact_inverse(inputs):
    return float64_products(inputs)[0]


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_grouped_inverse_matches_float64_and_the_per_head_kernel(heads, lengths):
    inputs = make_inputs(LENGTHS[lengths], *heads, seed=heads[1] * 10 + list(LENGTHS).index(lengths))
    grouped, per_head = run_inverses(inverse_inputs(inputs))
    torch.cuda.synchronize()
    exact = exact_inverse(inputs)
    # Every token row belongs to a chunk, so a NaN left here is a row the kernel never wrote.
    assert torch.isfinite(grouped).all(), "NaN/Inf (unwritten rows?)"
    err_grouped, err_per_head = relative_error(grouped, exact), relative_error(per_head, exact)
    print(f"\n{heads} {lengths}: relative L2 to float64 grouped {err_grouped:.2e}, per-head {err_per_head:.2e}")
    assert err_grouped <= INVERSE_TOLERANCE, err_grouped
    assert err_grouped <= 2 * err_per_head + 1e-3, (err_grouped, err_per_head)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("dtype,beta_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp16", "bf16_beta"])
def test_grouped_inverse_other_dtypes(dtype, beta_dtype):
    """float16 k, and beta handed over in bf16 (the api passes bf16/fp16 beta through)."""
    inputs = make_inputs([777, 1536], 4, 16, seed=3)
    args = inverse_inputs(inputs)
    args["k"], args["beta"] = args["k"].to(dtype), args["beta"].to(beta_dtype)
    grouped, _ = run_inverses(args)
    assert grouped.dtype == dtype and torch.isfinite(grouped).all()
    inputs = dict(inputs, k=args["k"].view(inputs["k"].shape), beta=args["beta"].view(inputs["beta"].shape))
    assert relative_error(grouped, exact_inverse(inputs)) <= INVERSE_TOLERANCE


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads", [(16, 64), (8, 24), (2, 8)], ids=["16_64", "8_24", "2_8"])
def test_grouped_inverse_is_bitwise_deterministic(heads):
    args = inverse_inputs(make_inputs(RAGGED + [4096], *heads, seed=7))
    assert torch.equal(run_inverses(args)[0], run_inverses(args)[0])
