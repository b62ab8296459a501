"""What the Hopper kernels and their host code share: the compile target, the shapes the kernels
are built for, and the constants of their math (docs/gdn-math.md).

Imports torch only, so that the backend registry (flashqla/backends.py) can check inputs against
these values on a machine without tilelang.
"""
import torch

TARGET = {"kind": "cuda", "arch": "sm_90a"}
HEAD_DIM = 128  # K = V: the only head size the kernels are built for
CHUNK_SIZE = 64  # C of docs/gdn-math.md §2
WARPGROUP = 128  # threads of a warpgroup, the unit that issues a wgmma product
INPUT_DTYPES = (torch.bfloat16, torch.float16)  # of q, k, v
LOG2E = 1.4426950408889634  # e^x = 2^(x log2 e): the kernels exponentiate with exp2
# How far a split sequence's piece may truncate the history it rebuilds its state from
# (docs/gdn-math.md §4): at most e^-10 ~ 4.5e-5 of the state there.
DEFAULT_LOG_DECAY_THRESHOLD = -10.0


def compile_for_hopper(program, fast_math: bool = False):
    """tilelang.compile for TARGET; fast_math turns on TileLang's approximate math (exp2 and the like)."""
    import tilelang  # here, not at the top: see the module docstring

    pass_configs = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True} if fast_math else None
    return tilelang.compile(program, target=TARGET, pass_configs=pass_configs)


def times_rstd(x, rstd_s, *index):
    """x times the L2 norm's r at `index` of the shared array rstd_s (a row t, or a stage and a row: TileLang
    expressions); x itself where rstd_s is None (no norm): how a kernel folds the norm into a product's row or
    column factors."""
    return x if rstd_s is None else x * rstd_s[index]


def dtype_name(tensor: torch.Tensor) -> str:
    """The dtype as TileLang spells it ("bfloat16")."""
    return str(tensor.dtype).removeprefix("torch.")


def unsupported_inputs(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """What of these q (like k) and v the kernels do not cover, as a phrase ("needs ..."), or None."""
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"needs K = V = {HEAD_DIM}, got K={q.shape[-1]}, V={v.shape[-1]}"
    if q.dtype not in INPUT_DTYPES or v.dtype != q.dtype:
        return f"needs q, k, v all bfloat16 or all float16, got q {q.dtype}, v {v.dtype}"
    return None
