"""Build every Hopper kernel for sm_90a without a GPU (CI runs this through tests/flashqla/test_hopper_compile.py).

    python -m flashqla.hopper.compile_check [--dump DIR] [--resources]

Each entry of COMPILE_CHECKS is (name, zero-argument builder returning a compiled kernel); one
representative specialisation per kernel and variant keeps the total compile time modest.
--dump writes each kernel's generated CUDA (NAME.cu) and its TIR (NAME.tir, what TileLang's cache
key hashes) to DIR: a refactor that must not change the kernels leaves `diff -r` of two dumps empty.
--resources prints what ptxas allots each kernel (registers a thread, bytes spilled, stack), so a change's
register pressure shows before any GPU runs it.
"""
import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from flashqla.hopper.backward_fused import DELTA_HEAVY_REGISTERS, compile_fused_backward
from flashqla.hopper.causal_conv import compile_conv_backward, compile_conv_forward
from flashqla.hopper.chunk_states import compile_chunk_states
from flashqla.hopper.fused_forward import compile_fused_forward
from flashqla.hopper.inverse import compile_inverse
from flashqla.hopper.l2norm import compile_l2norm_backward, compile_l2norm_forward
from flashqla.hopper.walk_bounds import compile_walk_bounds

COMPILE_CHECKS = [
    ("chunk_inverse", lambda: compile_inverse()),
    ("chunk_inverse_normalizing_qk", lambda: compile_inverse(normalize_qk=True)),
    ("fused_forward", lambda: compile_fused_forward(64)),
    ("fused_forward_keeping_states", lambda: compile_fused_forward(128, store_chunk_states=True)),
    ("fused_forward_normalizing_qk", lambda: compile_fused_forward(128, "bfloat16", "bfloat16", normalize_qk=True)),
    ("chunk_states", lambda: compile_chunk_states(64, with_transition=True)),
    ("backward_fused", compile_fused_backward),
    ("backward_fused_normalizing_qk", lambda: compile_fused_backward(normalize_qk=True)),
    ("backward_fused_l2norm", lambda: compile_fused_backward(normalize_qk=True, l2norm_backward=True)),
    ("backward_fused_delta_heavy_registers", lambda: compile_fused_backward(registers=DELTA_HEAVY_REGISTERS)),
    ("backward_fused_delta_heavy_registers_normalizing_qk",
     lambda: compile_fused_backward(True, registers=DELTA_HEAVY_REGISTERS)),
    ("backward_fused_delta_heavy_registers_l2norm",
     lambda: compile_fused_backward(True, l2norm_backward=True, registers=DELTA_HEAVY_REGISTERS)),
    ("causal_conv_forward", lambda: compile_conv_forward("bfloat16")),
    ("causal_conv_backward", lambda: compile_conv_backward("bfloat16")),
    ("causal_conv_forward_one_lane", lambda: compile_conv_forward("bfloat16", lanes=1)),  # odd widths
    ("causal_conv_backward_one_lane", lambda: compile_conv_backward("bfloat16", lanes=1)),
    ("walk_starts", lambda: compile_walk_bounds(False)),
    ("walk_ends", lambda: compile_walk_bounds(True)),
    ("l2norm_forward", lambda: compile_l2norm_forward("bfloat16")),
    ("l2norm_backward", lambda: compile_l2norm_backward("bfloat16")),
    ("l2norm_backward_float16", lambda: compile_l2norm_backward("float16", "bfloat16")),
]


def compile_all(dump: Path | None = None) -> list[str]:
    """Compile every kernel for sm_90a; returns the names built. Raises on the first failure."""
    built = []
    for name, build in COMPILE_CHECKS:
        kernel = build()
        source = kernel.get_kernel_source()
        if "__global__" not in source:
            raise RuntimeError(f"kernel {name} produced no CUDA source")
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{name}.cu").write_text(source)
            (dump / f"{name}.tir").write_text(kernel.prim_func.script(show_meta=True))
        built.append(name)
    return built


PTXAS_USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                         r".*?Used (\d+) registers", re.S)
# ptxas' performance warnings about wgmma (C7510-C7520: serialised, or a warpgroup.wait injected)
WGMMA_SERIALISED = re.compile(r"\(C75\d\d\)[^\n]*wgmma")


def ptxas_resources(kernel) -> dict[str, int]:
    """What ptxas allots a compiled TileLang kernel: {"registers", "spill_stores", "spill_loads", "stack"}
    (bytes a thread), and "serialised_wgmma" (1 where ptxas warns that it serialises or waits on the kernel's
    wgmmas: any of its C75xx lines naming wgmma, e.g. C7512 for want of registers with products in flight).
    Recompiles the kernel's CUDA with TileLang's own nvcc options and ptxas --verbose (TileLang keeps ptxas'
    report to itself)."""
    import tilelang
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    fast_math = bool((kernel.pass_configs or {}).get(tilelang.PassConfigKey.TL_ENABLE_FAST_MATH, False))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.cu"
        source.write_text(kernel.get_kernel_source())
        command = ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++20", f"-I{TILELANG_TEMPLATE_PATH}",
                   f"-I{CUTLASS_INCLUDE_DIR}", "--ptxas-options=--verbose", "-w", "-o", str(Path(tmp) / "kernel.cubin"),
                   str(source)] + (["--use_fast_math"] if fast_math else [])
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        report = done.stdout + done.stderr
    match = PTXAS_USAGE.search(report)
    if match is None:
        raise RuntimeError(f"no ptxas usage line in:\n{report}")
    stack, spill_stores, spill_loads, registers = map(int, match.groups())
    return dict(registers=registers, spill_stores=spill_stores, spill_loads=spill_loads, stack=stack,
                serialised_wgmma=int(WGMMA_SERIALISED.search(report) is not None))


# the most shared memory a block may have on H100 and H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_MEMORY_PER_BLOCK = 227 * 1024
_STATIC_SHARED = re.compile(r"__shared__ __align__\((\d+)\) (\w+) \w+\[(\d+)\];")
_ELEMENT_BYTES = {"uint64_t": 8, "float": 4, "int": 4, "bfloat16_t": 2, "half_t": 2}


def shared_memory_bytes(program) -> int:
    """The shared memory a block of `program` (a TileLang prim_func) asks for, lowered without nvcc: its static
    arrays (mbarriers, scope="shared" buffers), then the dynamic buffer from its own 1024-byte alignment, as large
    as the launch sets it (the last argument of the lowered host code's kernel call). A device refuses the launch
    past SHARED_MEMORY_PER_BLOCK ("Failed to set the allowed dynamic shared memory size")."""
    import tilelang
    from tvm.target import Target

    from flashqla.hopper.common import TARGET

    with Target(TARGET):
        artifact = tilelang.lower(program, target=TARGET)
    (dynamic,) = map(int, re.findall(r"T\.call_packed\(\"\w+_kernel\".*, (\d+)\)", artifact.host_mod.script()))
    static = 0
    for alignment, element, count in _STATIC_SHARED.findall(artifact.kernel_source):
        static = -(-static // int(alignment)) * int(alignment) + _ELEMENT_BYTES[element] * int(count)
    return -(-static // 1024) * 1024 + dynamic


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", type=Path, default=None, help="write NAME.cu and NAME.tir of every kernel here")
    parser.add_argument("--resources", action="store_true", help="print ptxas' registers and spills of every kernel")
    args = parser.parse_args()
    if args.resources:
        for name, build in COMPILE_CHECKS:
            usage = ptxas_resources(build())
            print(f"{name:40s} " + " ".join(f"{key} {value}" for key, value in usage.items()), flush=True)
    else:
        for built_name in compile_all(args.dump):
            print("built", built_name, flush=True)
