"""The inverse kernel (flashqla/hopper/inverse.py): A~ and gamma of every chunk against float64.

CPU: the block recipe the kernel follows, in torch (exact in float64; within budget with its 32x32
products on tf32 operands), and an audit of the generated CUDA. GPU (marked gpu, SM90): A~ on the
forward grid and on the hard inputs (beta over all of (0, 1), correlated keys), over the tensor and per
(sequence, head), NaN-poisoned memory in both allocator pools, other dtypes, groups of up to 32 value
heads, bitwise determinism. Run with -s to see the errors.
"""
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from flashqla.testing import relative_error
from hopper_grid import (HEAD_IDS, HEAD_LAYOUTS, LENGTHS, RAGGED, HardCase, assert_gamma_matches_float64,
                         float64_products, make_hard_inputs, make_inputs, on_hopper, poison_allocator,
                         sequence_head_errors)

requires_hopper = pytest.mark.skipif(not on_hopper, reason="needs an SM90 (Hopper) GPU")

# A~ is stored in bf16 (relative rounding 2^-9): it must sit well inside the forward's 1e-2 / 2e-2 budget.
TENSOR_TOLERANCE = 5e-3
SLICE_TOLERANCE = 1e-2


def _truncate_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """What a tf32 mma reads from fp32 bits: the low 13 mantissa bits dropped."""
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32).to(x.dtype)


def block_recipe(lower: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """(I + lower)^-1 for a strictly lower 64x64 `lower`, by the kernel's steps: 16x16 diagonal blocks by
    forward substitution, the 32x32 diagonal blocks' lower-left blocks, then the lower-left 32x32 block
    from two products (on tf32 operands when `tf32`)."""
    cast = _truncate_to_tf32 if tf32 else (lambda x: x)
    size, block, half = lower.shape[0], 16, 32
    diag = []
    for b in range(size // block):
        part = lower[b * block:(b + 1) * block, b * block:(b + 1) * block]
        inverse = torch.zeros_like(part)
        for col in range(block):
            column = torch.zeros(block, dtype=lower.dtype)
            for i in range(block):
                column[i] = float(i == col) - (part[i, :i] * column[:i]).sum()
            inverse[:, col] = column
        diag.append(inverse)
    halves = []
    for p in range(2):
        top = torch.zeros(half, half, dtype=lower.dtype)
        top[:block, :block], top[block:, block:] = diag[2 * p], diag[2 * p + 1]
        sub = lower[p * half + block:(p + 1) * half, p * half:p * half + block]
        top[block:, :block] = -diag[2 * p + 1] @ (sub @ diag[2 * p])
        halves.append(top)
    partial = cast(-lower[half:, :half]) @ cast(halves[0])
    result = torch.zeros_like(lower)
    result[:half, :half], result[half:, half:] = halves
    result[half:, :half] = cast(halves[1]) @ cast(partial)
    return result


def test_block_recipe_inverts_exactly_and_within_tf32_budget():
    gen = torch.Generator().manual_seed(0)
    size = 64
    for correlation in (0.0, 0.95):
        shared = torch.randn(1, 128, generator=gen, dtype=torch.float64)
        keys = F.normalize(correlation * shared + (1 - correlation) * torch.randn(size, 128, generator=gen,
                                                                                   dtype=torch.float64), dim=-1)
        beta = torch.rand(size, generator=gen, dtype=torch.float64)
        lower = torch.tril(beta[:, None] * (keys @ keys.T), -1)
        exact = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + lower)
        assert relative_error(block_recipe(lower), exact) <= 1e-12, correlation
        error = relative_error(block_recipe(lower, tf32=True), exact)
        assert error <= 2e-3, (correlation, error)


def test_block_recipe_test_fails_on_a_wrong_merge():
    """The recipe check can fail: dropping the sign of the 32x32 merge is caught."""
    gen = torch.Generator().manual_seed(1)
    keys = F.normalize(torch.randn(64, 128, generator=gen, dtype=torch.float64), dim=-1)
    lower = torch.tril(keys @ keys.T, -1)
    exact = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + lower)
    wrong = block_recipe(lower)
    wrong[32:, :32] *= -1
    assert relative_error(wrong, exact) > 1e-2


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


def test_inverse_cuda_loads_k_once_and_has_safe_barriers():
    """Audit of the generated CUDA, repeated on every TileLang version: the occupancy the kernel is built
    for; one TMA load (k's tile), armed once and waited for once before the first product reads it, so
    no load can land in bytes that L reuses later; no barrier inside the per-thread column solve (only
    64 threads reach it: a deadlock); no barrier at the top of an element loop (TileLang adds one per
    element when a loop reads a shared buffer indexed by a run-time value and writes another)."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to build the sm_90a kernel")
    from flashqla.hopper.inverse import MIN_BLOCKS_PER_SM, compile_inverse

    source = compile_inverse().get_kernel_source()
    assert f"__launch_bounds__(128, {MIN_BLOCKS_PER_SM})" in source
    assert source.count("arrive_and_expect_tx(") == 1 and source.count(".wait(") == 1
    assert source.count("tl::tma_load(") == 1 and "k_desc" in source.split("tl::tma_load(")[1].split(")")[0]
    assert source.index("tl::tma_load(") < source.index(".wait(") < source.index("tl::wgmma")
    column_solves = _blocks_opened_by(source, "if (((int)threadIdx.x) < 64)")
    assert len(column_solves) >= 2 and not any("__syncthreads" in body for body in column_solves)
    assert not re.search(r"for \(int [^)]*\) \{\s*__syncthreads\(\);", source)


def flat_args(inputs):
    """gamma_and_inverse's arguments for the op's inputs: flattened k, g and beta, the chunk bounds."""
    from flashqla.hopper.chunk_plan import chunk_bounds

    _, total, num_qk_heads, head_dim = inputs["k"].shape
    num_v_heads = inputs["v"].shape[2]
    return dict(k=inputs["k"].reshape(total, num_qk_heads, head_dim).contiguous(),
                g=inputs["g"].reshape(total, num_v_heads).contiguous(),
                beta=inputs["beta"].reshape(total, num_v_heads).contiguous(),
                chunk_bounds=chunk_bounds(inputs["cu_seqlens"]))


def run_inverse(inputs):
    """(gamma, A~) from the kernel, NaN in every free block first."""
    from flashqla.hopper.inverse import gamma_and_inverse

    args = flat_args(inputs)
    poison_allocator()
    return gamma_and_inverse(**args)


def check_against_float64(inputs, seq_lens, label: str):
    gamma, ours = run_inverse(inputs)
    torch.cuda.synchronize()
    exact = float64_products(inputs)[0]
    # Every token row belongs to a chunk, so a NaN left here is a row the kernel never wrote.
    assert torch.isfinite(ours).all() and torch.isfinite(gamma).all(), f"{label}: NaN/Inf (unwritten rows?)"
    assert_gamma_matches_float64(gamma, inputs["g"], inputs["cu_seqlens"])
    tensor_error = relative_error(ours, exact)
    slices = sequence_head_errors(ours[None], exact[None], seq_lens)
    print(f"\n{label}: A~ relative L2 to float64 {tensor_error:.2e}, worst (sequence, head) {slices.worst:.2e} "
          f"at {slices.worst_index}")
    assert tensor_error <= TENSOR_TOLERANCE, tensor_error
    assert slices.worst <= SLICE_TOLERANCE, (slices.worst, slices.worst_index)
    return ours


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_inverse_matches_float64(heads, lengths):
    inputs = make_inputs(LENGTHS[lengths], *heads, seed=heads[1] * 10 + list(LENGTHS).index(lengths))
    check_against_float64(inputs, LENGTHS[lengths], f"{heads} {lengths}")


HARD = [
    HardCase("wide_beta", (4, 16), (1, 1500, 0, 64, 2047, 129, 63), False, seed=1),
    HardCase("correlated", (4, 16), (1, 1500, 0, 64, 2047, 129, 63), False, correlated_keys=True, seed=2),
    HardCase("correlated_1x", (16, 16), (8192,), False, correlated_keys=True, seed=7),
]


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("case", HARD, ids=[case.name for case in HARD])
def test_inverse_on_hard_inputs(case):
    """beta over all of (0, 1) with both ends pinned; keys sharing one component (entries of A~ far from 1)."""
    inputs, _, _ = make_hard_inputs(case)
    check_against_float64(inputs, case.seq_lens, case.name)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads", [(1, 16), (2, 64)], ids=["1_16", "2_64"])
def test_inverse_of_large_groups(heads):
    """Groups of 16 and 32 value heads per qk head."""
    check_against_float64(make_inputs([777, 0, 1536], *heads, seed=5), [777, 0, 1536], f"{heads}")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("dtype,beta_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp16", "bf16_beta"])
def test_inverse_other_dtypes(dtype, beta_dtype):
    """float16 k, and beta and g handed over in bf16 (the api passes bf16/fp16 beta and g through)."""
    inputs = make_inputs([777, 1536], 4, 16, seed=3)
    inputs = dict(inputs, k=inputs["k"].to(dtype), beta=inputs["beta"].to(beta_dtype), g=inputs["g"].to(beta_dtype))
    ours = check_against_float64(inputs, [777, 1536], f"k {dtype}, beta {beta_dtype}")
    assert ours.dtype == dtype


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads", [(16, 64), (8, 24), (2, 8)], ids=["16_64", "8_24", "2_8"])
def test_inverse_is_bitwise_deterministic(heads):
    inputs = make_inputs(RAGGED + [4096], *heads, seed=7)
    first, second = run_inverse(inputs), run_inverse(inputs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def _unnormalized(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with its rows' norms spread from 0.01 to 10 and one row of zeros: what the L2 norm is given."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    norms = torch.logspace(-2, 1, x.shape[1], device=x.device)[torch.randperm(x.shape[1], generator=generator,
                                                                            device=x.device)]
    x = (x.float() * norms[None, :, None, None]).to(x.dtype)
    x[0, 0, 0] = 0
    return x


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("dtype,beta_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float32)], ids=["bf16", "bf16_beta", "fp16"])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_inverse_with_the_norm_matches_the_unfused_norm_bitwise(heads, dtype, beta_dtype):
    """normalize_q: the r of q and k as the l2norm kernel makes them, and gamma and A~ as the inverse makes
    them from the l2norm kernel's k^, bit for bit, on ragged lengths (a partial last chunk at the tensor's
    end), with NaN-poisoned memory (an unwritten row shows) and every value-head group member reading one
    q, k."""
    from flashqla.hopper.inverse import gamma_and_inverse
    from flashqla.hopper.l2norm import l2_normalized

    inputs = make_inputs(RAGGED + [100], *heads, seed=11)
    q = _unnormalized(inputs["q"], seed=1).to(dtype)
    k = _unnormalized(inputs["k"], seed=2).to(dtype)
    args = flat_args(dict(inputs, k=k, beta=inputs["beta"].to(beta_dtype)))
    q_flat = q.reshape(args["k"].shape).contiguous()
    poison_allocator()
    gamma, inverse, (fused_q_rstd, fused_k_rstd) = gamma_and_inverse(**args, normalize_q=q_flat)
    (_, q_rstd), (k_hat, k_rstd) = l2_normalized(q_flat), l2_normalized(args["k"])
    gamma_unfused, inverse_unfused = gamma_and_inverse(**dict(args, k=k_hat))
    torch.cuda.synchronize()
    for name, ours, unfused in (("r of q", fused_q_rstd, q_rstd), ("r of k", fused_k_rstd, k_rstd),
                                ("gamma", gamma, gamma_unfused), ("A~", inverse, inverse_unfused)):
        assert torch.isfinite(ours).all(), f"{name}: NaN or inf (an unwritten row?)"
        unfused = unfused.view(ours.shape)
        mismatched = (ours != unfused).sum().item()
        print(f"\n{heads} {dtype} beta {beta_dtype} {name}: {mismatched} of {ours.numel()} differ, largest "
              f"{(ours.float() - unfused.float()).abs().max().item():.2e}")
        assert mismatched == 0, name
