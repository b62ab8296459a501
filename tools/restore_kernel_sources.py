"""Put each cached TileLang kernel's CUDA source back where it was compiled, for Nsight Compute.

    python tools/restore_kernel_sources.py [CACHE_DIR]   (default $TILELANG_CACHE_DIR or /tmp/tlcache)

TileLang compiles a kernel from a temporary `tvm_kernels.cu` and deletes it; the cubin's line table
keeps that path, so a report collected with `--import-source yes` on the device, where the kernels
come from the cache built on the CPU, finds no file and keeps no source. The cache holds the same
source as `device_kernel.cu` next to the binary; this writes it to the recorded path of every
entry, so the report can import it and its source page can be read by line of CUDA.
"""
import os
import re
import sys
from pathlib import Path

_COMPILE_DIR = re.compile(rb"/tmp/tmp[A-Za-z0-9_]{6,16}(?=\x00)")


def restore(cache_dir: Path) -> int:
    restored = 0
    for binary in cache_dir.glob("*/*/kernels/*/executable.so"):
        source = binary.with_name("device_kernel.cu")
        found = _COMPILE_DIR.search(binary.read_bytes())
        if found is None or not source.exists():
            continue
        target = Path(found.group().decode()) / "tvm_kernels.cu"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text())
        restored += 1
    return restored


if __name__ == "__main__":
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TILELANG_CACHE_DIR", "/tmp/tlcache"))
    print(f"{restore(cache)} kernel sources restored from {cache}")
