"""The tools that run without a GPU: tools/ncu_top_stalls.py on made-up Nsight Compute source pages,
tools/restore_kernel_sources.py on a made-up kernel cache, tools/rounding_emulation.py on a small
hard case, and tools/walk_timeline.py's summary on made-up clock stamps."""
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"

PAGE = """==PROF== Connected to process 1
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x10","@P0 BAR.SYNC.DEFER_BLOCKING 0x0","120","100","1,000"
"0x20","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","30","20","500"
"0x30","FFMA R1, R2, R3, R4","50","10","8,000"
"0x40","FFMA R5, R6, R7, R8","0","0","8,000"
"""


def test_ncu_top_stalls_ranks_instructions_and_opcodes(tmp_path):
    page = tmp_path / "page.csv"
    page.write_text(PAGE)
    out = subprocess.run([sys.executable, str(TOOLS / "ncu_top_stalls.py"), str(page), "--top", "2"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "4 SASS instructions, 200 stall samples"
    assert out[1].split()[:3] == ["60.0%", "120", "0x10"] and "BAR.SYNC" in out[1]   # the predicate guard kept
    assert out[2].split()[:3] == ["25.0%", "50", "0x30"]
    assert len(out) == 4   # --top 2, then the opcode line
    assert out[3] == "by opcode: BAR 60.0%, FFMA 25.0%, HGMMA 15.0%"


def test_ncu_top_stalls_refuses_a_page_without_stall_samples(tmp_path):
    page = tmp_path / "page.csv"
    page.write_text('"Address","Source"\n"0x10","FFMA R1, R2, R3, R4"\n')
    run = subprocess.run([sys.executable, str(TOOLS / "ncu_top_stalls.py"), str(page)], capture_output=True, text=True)
    assert run.returncode != 0 and "stall-sampling" in run.stderr


LINES = """"Line","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"101","  tl::mbarrier_wait(delta_ready, parity);","70","60"
"102","  acc = acc + x * w;","20","5"
"103","}","10","0"
"""


def test_ncu_top_stalls_ranks_cuda_lines(tmp_path):
    page = tmp_path / "lines.csv"
    page.write_text(LINES)
    out = subprocess.run([sys.executable, str(TOOLS / "ncu_top_stalls.py"), str(page), "--cuda", "--top", "2"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "3 CUDA lines, 100 stall samples"
    assert out[1].split()[:3] == ["70.0%", "70", "101"] and "mbarrier_wait" in out[1]
    assert out[2].split()[:3] == ["20.0%", "20", "102"]
    assert len(out) == 3   # no opcode sums for source lines


def test_restore_kernel_sources_writes_each_source_where_its_binary_was_compiled(tmp_path):
    import uuid

    compile_dir = Path(f"/tmp/tmp{uuid.uuid4().hex[:8]}")
    entry = tmp_path / "0.1.15" / "linux-x86_64" / "kernels" / "abc123"
    entry.mkdir(parents=True)
    (entry / "executable.so").write_bytes(b"\x7fELF\x00" + str(compile_dir).encode() + b"\x00tvm_kernels.cu\x00")
    (entry / "device_kernel.cu").write_text("__global__ void k() {}\n")
    (tmp_path / "0.1.15" / "linux-x86_64" / "kernels" / "no_source").mkdir()  # skipped, not an error
    try:
        out = subprocess.run([sys.executable, str(TOOLS / "restore_kernel_sources.py"), str(tmp_path)],
                             capture_output=True, text=True, check=True).stdout
        assert out.startswith("1 kernel sources restored")
        assert (compile_dir / "tvm_kernels.cu").read_text() == "__global__ void k() {}\n"
    finally:
        (compile_dir / "tvm_kernels.cu").unlink(missing_ok=True)
        if compile_dir.exists():
            compile_dir.rmdir()


def test_rounding_emulation_is_the_reference_without_rounding_and_moves_with_it():
    sys.path.insert(0, str(TOOLS))
    import rounding_emulation

    from tests.flashqla.hopper_grid import HardCase

    case = HardCase("tools", (2, 4), (70, 1, 0, 5), True, seed=1)
    exact, rounded, narrower = rounding_emulation.errors_for(
        case, [set(), {"state", "grad_delta"}, {"state:tf32", "grad_delta:tf32"}])
    assert max(err.tensor for err in exact.values()) < 1e-12   # the kernels' arrangement, float64
    assert 1e-4 < rounded["o"].tensor < 1e-2 and 1e-4 < rounded["dbeta"].tensor < 1e-2
    assert rounded["dv"].tensor > 0 and rounded["o"].tensor > exact["o"].tensor
    assert 0 < narrower["o"].tensor < rounded["o"].tensor / 4  # tf32 keeps 3 more bits than bf16
    with pytest.raises(ValueError, match=r"points \['states'\]"):
        rounding_emulation.emulated_op({"states"})
    with pytest.raises(ValueError, match=r"points \['state'\]: .* with ':tf32'"):
        rounding_emulation.emulated_op({"state:fp8"})


def test_walk_timeline_takes_each_segment_to_the_next_event_and_the_last_to_the_next_chunk():
    import numpy as np

    sys.path.insert(0, str(TOOLS))
    from walk_timeline import format_summary, summarize

    events = {"state": ("top", "tiles", "updated"), "delta": ("top", "x")}
    ctas, chunks = 3, 10
    stamps = np.zeros((ctas, 2, chunks, 3), dtype=np.int64)
    for c in range(chunks):  # state: 100-cycle chunks, 30 waiting for tiles, 70 updating; delta: 40 then 60
        stamps[:, 0, c, :3] = 1000 + 100 * c + np.array([0, 30, 100 - 1])
        stamps[:, 1, c, :2] = 1000 + 100 * c + np.array([5, 45])
    stamps[2, :, 6:] = 0  # a CTA that walked 6 chunks
    summary = summarize(stamps, events, skip=2)
    assert summary["period"] == 100
    assert summary["state"] == [("top -> tiles", 30), ("tiles -> updated", 69), ("updated -> next top", 1)]
    assert summary["delta"] == [("top -> x", 40), ("x -> next top", 60)]
    lines = format_summary(summary)
    assert lines[0] == "chunk period (state warpgroup, top to top): 100 cycles"
    assert lines[1].startswith("state: top -> tiles 30 (30%)")


def test_walk_timeline_spread_finds_the_slow_cta_its_chunk_and_segment_and_counts_warm_up_chunks():
    import numpy as np

    sys.path.insert(0, str(TOOLS))
    from walk_timeline import format_spread, spread

    events = {"state": ("top", "tiles", "updated"), "delta": ("top", "own")}
    ctas, chunks = 4, 8
    stamps = np.zeros((ctas, 2, chunks, 3), dtype=np.int64)
    for cta in range(ctas):
        clock = 1000
        for c in range(chunks):
            wait = 930 if (cta, c) == (2, 5) else 30  # CTA 2 waits 900 cycles longer for its tiles in chunk 5
            stamps[cta, 0, c, :3] = clock + np.array([0, wait, wait + 60])
            stamps[cta, 1, c, 0] = clock + 1
            if c >= cta:  # CTA i's first i chunks are its warm-up
                stamps[cta, 1, c, 1] = clock + 2
            clock += wait + 70
    stamps[3, :, 6:] = 0  # a CTA that walked 6 chunks
    result = spread(stamps, events, own=("delta", "own"))
    assert result["chunks"] == [6, 8.0, 8]
    assert result["warm_up_chunks"] == [0, 1.5, 3]
    assert result["period_percentiles"]["50"] == 100
    assert result["median_period_by_chunk"] == [100] * 7
    slowest = result["slowest"][0]
    assert (slowest["cta"], slowest["chunk"], slowest["period"]) == (2, 5, 1000)
    assert (slowest["segment"], slowest["segment_cycles"]) == ("top -> tiles", 930)
    assert result["span"][2] == 7 * 100 + 900
    lines = format_spread(result)
    assert lines[2].startswith("chunk period percentiles: 5% 100")
    assert lines[-4].startswith("slow CTA 2 (8 chunks): 1000 cycles at chunk 5, most in top -> tiles 930")
