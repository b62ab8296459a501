"""Run a TileLang kernel's generated CUDA on the CPU, for kernels whose threads never talk to each other
(no shared memory, barriers, shuffles or tensor cores: the conv kernels of flashqla/hopper/causal_conv.py).

The source is compiled by the host C++ compiler with blockIdx / threadIdx as globals and a launcher
that runs every (block, thread) in turn, so two kernels that should do the same arithmetic can be
compared bitwise without a GPU. Float32 and int32 tensors only (the host has no bf16 vector types);
no FMA contraction, so the comparison sees each kernel's own order of operations.
"""
import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
struct Index { int x, y, z; };
static Index blockIdx, threadIdx;
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
using std::max;
using std::min;
#define __global__
#define __launch_bounds__(threads, blocks)
#define __restrict__
"""
_SIGNATURE = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+), \d+\) (\w+)\(([^)]*)\)')


def host_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


class HostKernel:
    """kernel(grid=(x, y), **arguments): the kernel's parameters by name (tensors or ints)."""

    def __init__(self, source: str):
        body = source[source.index('extern "C"'):]
        match = _SIGNATURE.search(body)
        if match is None:
            raise ValueError("no `extern \"C\" __global__ void __launch_bounds__(...)` kernel in the source")
        self.threads = int(match.group(1))
        name, signature = match.group(2), match.group(3)
        self.parameters = [(p.strip().rsplit(" ", 1)[1], "*" in p) for p in signature.split(",")]
        launcher = f"""
extern "C" void launch(int grid_x, int grid_y, {signature}) {{
  for (int block_y_ = 0; block_y_ < grid_y; ++block_y_)
    for (int block_x_ = 0; block_x_ < grid_x; ++block_x_)
      for (int thread_ = 0; thread_ < {self.threads}; ++thread_) {{
        blockIdx = {{block_x_, block_y_, 0}};
        threadIdx = {{thread_, 0, 0}};
        {name}({", ".join(p for p, _ in self.parameters)});
      }}
}}
"""
        code = _PRELUDE + body + launcher
        build = Path(tempfile.gettempdir()) / "flashqla-host-kernels"
        build.mkdir(exist_ok=True)
        library = build / f"{hashlib.sha256(code.encode()).hexdigest()[:16]}.so"
        if not library.exists():
            cpp = library.with_suffix(".cpp")
            cpp.write_text(code)
            subprocess.run([host_compiler(), "-O1", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off",
                            "-fno-strict-aliasing", "-w", str(cpp), "-o", str(library)], check=True)
        self._launch = ctypes.CDLL(str(library)).launch

    def __call__(self, grid: tuple[int, int], **arguments):
        values = []
        for name, is_pointer in self.parameters:
            value = arguments[name]
            if is_pointer:
                if value.device.type != "cpu" or value.dtype not in (torch.float32, torch.int32) \
                        or not value.is_contiguous():
                    raise ValueError(f"{name}: expected a contiguous float32 or int32 CPU tensor")
                values.append(ctypes.c_void_p(value.data_ptr()))
            else:
                values.append(ctypes.c_int(int(value)))
        self._launch(ctypes.c_int(grid[0]), ctypes.c_int(grid[1]), *values)
