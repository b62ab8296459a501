"""Compile the TileLang kernels the device bench and tests need, here, without a GPU.

    python tools/precompile_kernels.py [--out .devkit/tlcache.tgz] [--shapes SUBSTR,...] [--skip-flashqla]
                                       [--skip-ours] [--skip-fla] [--fused-forms FILE,...]

TileLang keys its disk cache on the kernel's TIR, its arguments, the target string, the
TileLang version and the machine type (x86_64), nothing of the GPU itself. Our kernels name
their target ({"kind": "cuda", "arch": "sm_90a"}); FlashQLA's use "auto", which on an H200
resolves to the same Target, so compiling FlashQLA under `with Target(sm_90a)` gives the keys the
device computes. Nothing here runs a kernel: JITKernel.__call__ is replaced by a no-op and the
host code of both libraries runs on CPU tensors of the bench's shapes, so every specialisation
the host code asks for gets compiled. FlashQLA sizes some grids from the SM count at import
time: it is told the H200's 132 SMs.

FLA runs Triton kernels except one: on Hopper its backward's dq/dk/dw/dg kernel is TileLang
(fla/ops/common/backends/tilelang/chunk_bwd.py). fla needs Triton to import, which a CPU machine
lacks, so that one file is loaded alone with stand-ins for its Triton and fla imports (only used
at call time) and its builder is called with the arguments FLA passes on an H200.

The cache is written to TILELANG_CACHE_DIR (default /tmp/tlcache) and packed to --out, which
.devkit/setup.sh restores on the device.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import types
from pathlib import Path

H200_SM_COUNT = 132
TARGET = {"kind": "cuda", "arch": "sm_90a"}
# GDN head layouts (qk heads, v heads) of the training runs: 0.8B and 2B at tp 1, and at tp 2.
MODEL_HEADS = [(16, 16), (8, 8)]
MODEL_SEQ_LENS = {"1x8192": [8192], "1x131072": [131072]}
# The GPU tests' grid (tests/flashqla/test_hopper_forward.py, test_hopper_backward.py), with and without h0,
# and one float16 case.
TEST_HEADS = [(16, 64), (16, 32), (16, 16), (8, 24), (2, 8)]
TEST_SEQ_LENS = {"1x4096": [4096], "ragged": [1000, 0, 64, 2047, 1, 129, 640], "1x32768": [32768]}
# tests/flashqla/test_hopper_hard_inputs.py: (layout, lengths, with h0) of its bf16 cases.
HARD_RAGGED = [1, 1500, 0, 64, 2047, 129, 63, 700, 0]
HARD_CASES = [((4, 16), HARD_RAGGED, True), ((4, 16), [8192], True), ((16, 32), HARD_RAGGED, False),
              ((16, 32), [5000, 1, 0, 3191], True), ((16, 16), HARD_RAGGED, True), ((16, 16), [8192], False)]


def pretend_h200() -> None:
    """Make the CUDA queries FlashQLA's host code makes answer as on one H200 (CPU tensors)."""
    import torch

    properties = types.SimpleNamespace(multi_processor_count=H200_SM_COUNT, name="NVIDIA H200",
                                       major=9, minor=0, total_memory=141 * 2**30)
    torch.cuda.get_device_properties = lambda *args, **kwargs: properties
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda index=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0


def skip_kernel_launches() -> None:
    from tilelang.jit.kernel import JITKernel

    JITKernel.__call__ = lambda self, *args, **kwargs: None


def cpu_inputs(heads: tuple[int, int], seq_lens: list[int], requires_grad: bool, like_the_model: bool = False) -> dict:
    """The bench's inputs (flashqla.bench.make_inputs) with the same shapes and dtypes, on CPU.
    like_the_model: as `make_inputs(like_the_model=True)`: bf16 beta, no initial or final state, the L2
    norm in the kernel."""
    import torch

    num_qk_heads, num_v_heads = heads
    total = sum(seq_lens)
    tensors = dict(
        q=torch.randn(1, total, num_qk_heads, 128, dtype=torch.bfloat16),
        k=torch.randn(1, total, num_qk_heads, 128, dtype=torch.bfloat16),
        v=torch.randn(1, total, num_v_heads, 128, dtype=torch.bfloat16),
        g=-torch.rand(1, total, num_v_heads) / 16,
        beta=torch.rand(1, total, num_v_heads),
        initial_state=torch.randn(len(seq_lens), num_v_heads, 128, 128),
    )
    if like_the_model:
        tensors["beta"] = tensors["beta"].to(torch.bfloat16)
        del tensors["initial_state"]
    for tensor in tensors.values():
        tensor.requires_grad_(requires_grad)
    tensors["cu_seqlens"] = torch.tensor([0, *seq_lens]).cumsum(0)
    return tensors


def compile_flashqla(shapes, like_the_model: bool = False) -> None:
    """Run FlashQLA's forward (no_grad) and forward + backward for each shape, kernels skipped.
    like_the_model: forward + backward only, on the inputs the bench's --model mode passes."""
    import torch
    from tvm.target import Target

    with Target(TARGET):
        import flash_qla
        import flash_qla.utils.math as flashqla_math

        if like_the_model:
            # its q/k L2 norm is torch.compile'd, which needs CUDA here; the TileLang kernels after it
            # see only shapes and dtypes, so the eager function it wraps serves as well
            for name in ("l2norm_fwd_compiled", "l2norm_bwd_compiled"):
                compiled = getattr(flashqla_math, name)
                setattr(flashqla_math, name, getattr(compiled, "_torchdynamo_orig_callable", compiled))
        for name, heads, seq_lens in shapes:
            started = time.time()
            if like_the_model:
                x = cpu_inputs(heads, seq_lens, requires_grad=True, like_the_model=True)
                o, _ = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"])
                o.backward(torch.randn_like(o))
                print(f"flashqla {name} as the model calls it: {time.time() - started:.0f} s", flush=True)
                continue
            x = cpu_inputs(heads, seq_lens, requires_grad=False)
            with torch.no_grad():
                flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                 initial_state=x["initial_state"], output_final_state=True,
                                                 cu_seqlens=x["cu_seqlens"])
            x = cpu_inputs(heads, seq_lens, requires_grad=True)
            o, final_state = flash_qla.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                output_final_state=True, cu_seqlens=x["cu_seqlens"])
            torch.autograd.backward((o, final_state), (torch.randn_like(o), torch.randn_like(final_state)))
            print(f"flashqla {name}: {time.time() - started:.0f} s", flush=True)


def compile_ours(shapes, like_the_model: bool = False, with_initial_state: bool = True, dtype_name: str = "bfloat16"):
    """Our forward and backward entries on CPU tensors, kernels skipped (they pick BV etc. per shape).

    like_the_model: inputs as the model's GDN layer passes them (bf16 beta, no initial state, no
    final state, dense [1, T] without cu_seqlens) instead of the bench's."""
    import torch

    from flashqla.hopper.backward import backward
    from flashqla.hopper.forward import forward

    dtype = getattr(torch, dtype_name)
    for name, heads, seq_lens in shapes:
        started = time.time()
        x = cpu_inputs(heads, seq_lens, requires_grad=False)
        q, k, v = (x[n].to(dtype) for n in ("q", "k", "v"))
        if like_the_model:
            beta, h0, cu, d_state = x["beta"].to(torch.bfloat16), None, None, None
        else:
            beta, cu = x["beta"], x["cu_seqlens"].to(torch.int32)
            h0 = x["initial_state"] if with_initial_state else None
            d_state = torch.randn_like(x["initial_state"])
        # the model's layer L2-normalises q and k in the inverse's kernel
        forward(q, k, v, x["g"], beta, None, h0, not like_the_model, cu, normalize_qk=like_the_model)
        backward(q, k, v, x["g"], beta, 128 ** -0.5, h0, cu, torch.randn_like(v), d_state)
        # the variant a differentiated forward runs (the walk that stores the chunk states), and the
        # backward that reads them
        _, _, kept, *_ = forward(q, k, v, x["g"], beta, None, h0, not like_the_model, cu, keep_for_backward=True,
                                 normalize_qk=like_the_model)
        backward(q, k, v, x["g"], beta, 128 ** -0.5, h0, cu, torch.randn_like(v), d_state, kept=kept)
        variant = "as the model calls it" if like_the_model else f"{dtype_name}, h0={with_initial_state}"
        print(f"ours {name} ({variant}): {time.time() - started:.0f} s", flush=True)


def compile_walks() -> None:
    """The forward walk (flashqla/hopper/fused_forward.py) and the inverse (inverse.py) in every
    specialisation the tests and the training runs reach (head counts and lengths are run-time
    arguments of both): V blocks, dtypes, and what the walk stores; the state-only walk
    (chunk_states.py) as the tests call it."""
    from flashqla.hopper.chunk_states import compile_chunk_states
    from flashqla.hopper.fused_forward import compile_fused_forward
    from flashqla.hopper.inverse import compile_inverse

    started = time.time()
    for dtype, beta_dtype in (("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32")):
        compile_inverse(128, dtype, beta_dtype)
        compile_inverse(128, dtype, beta_dtype, normalize_qk=True)
        for value_block in (32, 64, 128):
            for states in (False, True):  # the chunk states stored: with autograd, and the backward's rewalk
                compile_fused_forward(value_block, dtype, beta_dtype, 128, states)
    compile_inverse(128, "bfloat16", "bfloat16", "bfloat16")  # g in bf16 too (test_hopper_inverse.py)
    # the state-only walk the forward and kept-forward tests check against: (h0, states stored, transition)
    for use_initial_state, store, transition in ((True, True, False), (False, False, True), (True, False, False)):
        compile_chunk_states(64, use_initial_state=use_initial_state, store_chunk_states=store,
                             with_transition=transition)
    for value_block in (64, 128):  # tools/walk_timeline.py: the recording walk, storing everything or nothing
        for stored in (True, False):
            compile_fused_forward(value_block, "bfloat16", "float32", 128, stored, record_timeline=True)
    print(f"ours, walks: {time.time() - started:.0f} s", flush=True)


def compile_fused_backward_forms(paths: list[str]) -> None:
    """The fused reverse walk (flashqla/hopper/backward_fused.py, one kernel a variant: run-time shapes) in the
    variants its bench, tests and timelines run (plain, the L2 norm, the norm's backward inside the walk, each also
    recording its timeline; the delta-heavy register budget where a form has it), from the tree's file and from
    each candidate form's file in paths (tools/device_session.sh's fused-*:FORM parts put
    .devkit/alt/backward_fused_FORM.py in the tree's place; the cache keys do not depend on the file's path)."""
    import importlib
    import importlib.util
    import inspect

    modules = [importlib.import_module("flashqla.hopper.backward_fused")]
    for index, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"fused_backward_form_{index}", path)
        modules.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(modules[-1])
    for name, module in zip(["the tree's", *paths], modules):
        started = time.time()
        switches = inspect.signature(module.compile_fused_backward).parameters
        norms = [(False, {}), (True, {})]
        if "l2norm_backward" in switches:
            norms.append((True, dict(l2norm_backward=True)))  # the norm's backward inside
        budgets = [{}]
        if "registers" in switches:
            budgets.append(dict(registers=module.DELTA_HEAVY_REGISTERS))
        for budget in budgets:
            for normalize_qk, norm in norms:
                # tools/walk_timeline.py --backward records the walk's own budget only
                for record_timeline in (False, True) if not budget else (False,):
                    module.compile_fused_backward(normalize_qk, record_timeline, **norm, **budget)
        print(f"fused backward, {name}: {time.time() - started:.0f} s", flush=True)


def compile_checks() -> None:
    """One representative specialisation of every kernel of ours (flashqla/hopper/compile_check.py,
    what CI compiles)."""
    from flashqla.hopper.compile_check import COMPILE_CHECKS

    for name, build in COMPILE_CHECKS:
        started = time.time()
        build()
        print(f"check {name}: {time.time() - started:.0f} s", flush=True)


def compile_fla_tilelang(head_layouts) -> None:
    """FLA's TileLang dq/dk/dw/dg backward kernel, for packed (varlen) and dense inputs."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("fla")
    if spec is None:
        print("fla-core not installed: FLA's TileLang kernel skipped")
        return
    path = Path(spec.origin).parent / "ops/common/backends/tilelang/chunk_bwd.py"
    # chunk_bwd.py's imports of triton and fla are used only when FLA calls it; the builder needs none.
    stand_ins = {"triton": {}, "fla": {}, "fla.ops": {}, "fla.ops.utils": {"prepare_chunk_indices": None},
                 "fla.utils": {"check_shared_mem": None}}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    for name, attrs in stand_ins.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attrs)
    namespace = {"__name__": "fla.ops.common.backends.tilelang.chunk_bwd"}
    try:
        exec(compile(path.read_text(), str(path), "exec", dont_inherit=True), namespace)  # not our __future__ flags
    finally:
        # a stand-in triton left in sys.modules breaks torch.compile's import (FlashQLA uses it)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    build = namespace["_build_chunk_bwd_dqkwg_kernel"]

    from tvm.target import Target

    with Target(TARGET):
        for num_qk_heads, num_v_heads in head_layouts:
            # the bench packs sequences (varlen); training runs of the model may pass dense batches too
            for varlen in (True, False) if (num_qk_heads, num_v_heads) in MODEL_HEADS else (True,):
                started = time.time()
                # as chunk_bwd_dqkwg_tilelang calls it for K = V = 128, bf16, gated, on a GPU with
                # Hopper's shared memory (64-wide tiles)
                build(B=1, H=num_qk_heads, HV=num_v_heads, K=128, V=128, BT=64, BK=64, BV=64, NK=2, hD1=128,
                      hD2=128, dtype_str="bfloat16", USE_G=True, USE_DW=True, STATE_V_FIRST=False,
                      IS_VARLEN=varlen, num_warps=4)
                print(f"fla {num_qk_heads}/{num_v_heads} varlen={varlen}: {time.time() - started:.0f} s", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".devkit/tlcache.tgz", help="tarball of the cache folder ('' to skip)")
    parser.add_argument("--merge", default=None,
                        help="comma-separated cache tarballs to start from (default: --out when it exists, e.g. "
                             "one the device sent back)")
    parser.add_argument("--sets", default="bench,model,tests,hard,compare",
                        help="bench: the bench's shapes for ours, FLA and FlashQLA; model: the training runs' "
                             "head layouts for ours and FLA, and flashqla.bench --model's shapes for FlashQLA; tests: the GPU tests' grid and compile checks for ours; "
                             "hard: the hard-input GPU tests' cases; compare: what `flashqla.bench --compare` adds to the bench's")
    parser.add_argument("--shapes", default="", help="comma-separated substrings of flashqla.bench shape names")
    parser.add_argument("--fused-forms", default="",
                        help="comma-separated files of candidate forms of flashqla/hopper/backward_fused.py to compile "
                             "too (e.g. .devkit/alt/backward_fused_prev.py); the tree's own is in the tests set")
    parser.add_argument("--skip-flashqla", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--skip-fla", action="store_true")
    args = parser.parse_args(argv)

    cache_dir = Path(os.environ.setdefault("TILELANG_CACHE_DIR", "/tmp/tlcache"))
    merge = args.merge if args.merge is not None else (args.out if args.out and Path(args.out).exists() else "")
    cache_dir.mkdir(parents=True, exist_ok=True)
    for tarball in filter(None, merge.split(",")):
        # each tarball holds one folder named tlcache (setup.sh packs /tmp/tlcache)
        subprocess.run(["tar", "-xzf", tarball, "-C", str(cache_dir), "--strip-components=1"], check=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    pretend_h200()
    skip_kernel_launches()
    from flashqla.bench import bench_shapes

    sets = set(args.sets.split(","))
    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in bench_shapes() if not wanted or any(w in s[0] for w in wanted)] if "bench" in sets else []
    model_shapes = [(f"{a}/{b} {name}", (a, b), lens) for a, b in MODEL_HEADS for name, lens in MODEL_SEQ_LENS.items()]
    if "model" not in sets:
        model_shapes = []
    test_shapes = [(f"{a}/{b} {name}", (a, b), lens) for a, b in TEST_HEADS for name, lens in TEST_SEQ_LENS.items()]
    if "tests" not in sets:
        test_shapes = []
    if not args.skip_ours:
        compile_ours(shapes)
        compile_ours(model_shapes, like_the_model=True)
        for with_initial_state in (False, True):  # the forward and backward grids run both
            compile_ours(test_shapes, with_initial_state=with_initial_state)
        if test_shapes:
            compile_ours([("4/16 777+1536", (4, 16), [777, 1536])], dtype_name="float16")
            compile_ours([("4/4 777+1536", (4, 4), [777, 1536])], dtype_name="float16")  # the hard inputs' float16 case at Hv = Hqk
            # a group of 16 value heads per qk head (tests/flashqla/test_hopper_forward.py, keep_forward)
            compile_ours([("1/16 4096", (1, 16), [4096])])
            compile_checks()
            compile_walks()
            compile_fused_backward_forms([])
            from flashqla.hopper.causal_conv import compile_conv_backward, compile_conv_forward
            from flashqla.hopper.l2norm import compile_l2norm_backward, compile_l2norm_forward

            # tests/flashqla/test_causal_conv.py: every dtype at 4, 2 and 1 lanes (6144, 130 and 129 channels)
            for conv_dtype in ("bfloat16", "float16", "float32"):
                for lanes in (4, 2, 1):
                    compile_conv_forward(conv_dtype, lanes=lanes)
                    compile_conv_backward(conv_dtype, lanes=lanes)
            compile_l2norm_forward("float16")  # tests/flashqla/test_l2norm.py, the hard inputs' fp16 case
            compile_l2norm_backward("float16")
            compile_l2norm_backward("float16", "bfloat16")  # the op's float16 rows: bf16 gradients from the kernels
        if "hard" in sets:
            for heads, lens, with_h0 in HARD_CASES:
                compile_ours([(f"hard {heads[0]}/{heads[1]} {lens}", heads, lens)], with_initial_state=with_h0)
        if "compare" in sets:
            compile_ours([("16/16 1x131072", (16, 16), [131072])])
            from flashqla.hopper.causal_conv import compile_conv_backward

            for block_tokens in (128, 64):  # bench --compare conv: the backward's shorter token blocks
                compile_conv_backward("bfloat16", 4, 4, block_tokens)
    forms = [path for path in args.fused_forms.split(",") if path]
    if forms:
        compile_fused_backward_forms(forms)
    if not args.skip_fla:
        compile_fla_tilelang(sorted({heads for _, heads, _ in shapes + model_shapes}))
    if not args.skip_flashqla:
        compile_flashqla(shapes)
        if "model" in sets:  # flashqla.bench --model
            from flashqla.bench import MODEL_SHAPES

            compile_flashqla(MODEL_SHAPES, like_the_model=True)
    if args.out:
        out = Path(args.out).resolve()
        # setup.sh unpacks the tarball into /tmp and expects the folder tlcache. cuda-binaries (nvcc
        # output keyed by CUDA source, used only when a kernel's own key misses) would add ~70% for
        # no hit: leave it out to keep the carry under 64 MiB.
        subprocess.run(["tar", "-czf", str(out), "-C", str(cache_dir.parent), "--exclude=cuda-binaries",
                        "--exclude=.staging", f"--transform=s,^{cache_dir.name},tlcache,", cache_dir.name],
                       check=True)
        print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
