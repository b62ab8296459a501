"""CI (no GPU): every TileLang kernel lowers and compiles for sm_90a."""
import re
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")

if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc to compile the sm_90a kernels", allow_module_level=True)

from flashqla.hopper.compile_check import COMPILE_CHECKS, ptxas_resources  # noqa: E402

# What TileLang emits where an index expression such as `block % num_v_heads` is inlined into every
# index that uses it instead of held in a T.alloc_var: a 64-bit division by a run-time count, about
# 80 instructions each (the chunk-gradient kernel had 57 per task, 2 ms of its 7 at 16/64 x 32768).
SIXTY_FOUR_BIT_DIVISION = re.compile(r"[%/] \(\(int64_t\)")


@pytest.mark.parametrize("name,build", COMPILE_CHECKS, ids=[name for name, _ in COMPILE_CHECKS])
def test_kernel_compiles_for_sm90a_without_64_bit_divisions(name, build):
    kernel = build()
    source = kernel.get_kernel_source()
    assert "__global__" in source, f"{name}: no CUDA kernel in the generated source"
    divisions = SIXTY_FOUR_BIT_DIVISION.findall(source)
    assert not divisions, f"{name}: {len(divisions)} 64-bit divisions in the generated CUDA"


# Bytes a thread ptxas spills (stores + loads) in each kernel as committed, from
# `python -m flashqla.hopper.compile_check --resources`; kernels not named spill nothing. A change that spills
# more fails here, on the CPU, before a GPU times it: the four-warpgroup chunk gradients' ~300 bytes a thread
# made them 1.3-1.5x slower (docs/kernel-notes.md). Lower a ceiling when a change spills less.
SPILL_CEILINGS = {
    "chunk_inverse_normalizing_qk": 8,
    "fused_forward": 8,
    "fused_forward_keeping_states": 12,
    "fused_forward_normalizing_qk": 12,
    # the fused reverse walk at 160 / 168 / 152 / 32 registers (state, delta, products, loads;
    # 160 / 176 / 144 and 152 / 184 / 144 spill more); the delta role holds dk and half of dq at once, the state
    # role its epilogue
    "backward_fused": 232,
    "backward_fused_normalizing_qk": 552,
    "backward_fused_l2norm": 488,  # no r_k to keep for a division: fewer than the norm's plain variant
    # the loads role at 24 registers, the delta role at 176 (a candidate)
    "backward_fused_delta_heavy_registers": 208,
    "backward_fused_delta_heavy_registers_normalizing_qk": 492,
    "backward_fused_delta_heavy_registers_l2norm": 500,
}


def test_spill_ceilings_name_only_checked_kernels():
    assert set(SPILL_CEILINGS) <= {name for name, _ in COMPILE_CHECKS}


@pytest.mark.parametrize("name,build", COMPILE_CHECKS, ids=[name for name, _ in COMPILE_CHECKS])
def test_kernel_spills_no_more_than_its_ceiling_and_keeps_its_products_asynchronous(name, build):
    """Also: ptxas serialises no kernel's wgmmas (a candidate of the fused walk with E Delta dS1^T in flight
    under dU made it do so: C7512, 592 bytes spilled; forty-second session)."""
    usage = ptxas_resources(build())
    spilled = usage["spill_stores"] + usage["spill_loads"]
    assert spilled <= SPILL_CEILINGS.get(name, 0) and not usage["serialised_wgmma"], f"{name}: {usage}"


@pytest.mark.parametrize("normalize_qk,l2norm_backward", [(False, False), (True, False), (True, True)],
                         ids=["plain", "normalizing_qk", "l2norm"])
def test_fused_backward_fits_a_blocks_shared_memory(normalize_qk, l2norm_backward):
    """The fused reverse walk holds a chunk's tiles in shared memory with ~6 KB to spare (a second k with its
    barriers asked for 232496 bytes, and every launch failed on the H100): a tile more and none runs."""
    from flashqla.hopper.backward_fused import fused_backward_program
    from flashqla.hopper.compile_check import SHARED_MEMORY_PER_BLOCK, shared_memory_bytes

    used = shared_memory_bytes(fused_backward_program(normalize_qk, l2norm_backward=l2norm_backward))
    assert 200 * 1024 < used <= SHARED_MEMORY_PER_BLOCK, used


def warp_specialised_kernels():
    """(name, builder) of the kernels whose roles run on their own warpgroups: the forward walk and the fused
    reverse walk."""
    from flashqla.hopper.backward_fused import DELTA_HEAVY_REGISTERS, compile_fused_backward
    from flashqla.hopper.fused_forward import compile_fused_forward

    return [(f"fused_forward_{value_block}",
             lambda value_block=value_block: compile_fused_forward(value_block, store_chunk_states=True))
            for value_block in (64, 128)] + [
        (f"fused_backward_{variant}", lambda normalize_qk=normalize_qk, norm=norm: compile_fused_backward(
            normalize_qk, l2norm_backward=norm))
        for variant, normalize_qk, norm in (("plain", False, False), ("normalizing_qk", True, False),
                                            ("l2norm", True, True))] + [
        ("fused_backward_delta_heavy_registers", lambda: compile_fused_backward(registers=DELTA_HEAVY_REGISTERS))]


@pytest.mark.parametrize("name,build", warp_specialised_kernels(), ids=[name for name, _ in warp_specialised_kernels()])
def test_warp_specialised_kernels_meet_only_on_mbarriers(name, build):
    """Warpgroups that meet only on mbarriers and named partial barriers (a __syncthreads() inside a role would
    deadlock: the others never reach it), one register budget a role that fits the SM, raised only from and
    lowered only to the 128 a thread starts with (setmaxnreg.inc / .dec: the other way round is undefined), and no
    barrier at the top of an unrolled element loop (what TileLang emits for a shared buffer updated in place)."""
    import re

    source = build().get_kernel_source()
    assert source.count("__syncthreads()") == 1, "only the one after the mbarrier init"
    assert source.index("__syncthreads()") < source.index("threadIdx.x) < 128")
    raised = [int(n) for n in re.findall(r"warpgroup_reg_alloc<(\d+)>", source)]
    lowered = [int(n) for n in re.findall(r"warpgroup_reg_dealloc<(\d+)>", source)]
    assert len(raised) + len(lowered) == 4, "one budget for each of the four warpgroups"
    assert all(n >= 128 for n in raised) and all(n <= 128 for n in lowered), (raised, lowered)
    assert 128 * (sum(raised) + sum(lowered)) <= 65536
    lines = source.splitlines()
    barrier_loops = [i for i, line in enumerate(lines[:-1])
                     if line.strip().startswith("for (") and "__sync_thread_partial" in lines[i + 1]]
    assert not barrier_loops, [lines[i].strip() for i in barrier_loops]
    assert "wgmma" in source and "tma_load" in source
    # TileLang numbers its own partial barriers one a role from 3; the fused walk's delta role adds its own
    # (_DELTA_BARRIER), which must stay clear of them or two roles would meet on one barrier
    from flashqla.hopper.backward_fused import _DELTA_BARRIER

    ids = {int(n) for n in re.findall(r"__sync_thread_partial\((\d+), \d+\)", source)}
    assert max(ids - {_DELTA_BARRIER}, default=0) < _DELTA_BARRIER, sorted(ids)


def test_fused_forward_reads_the_clock_only_when_recording_a_timeline():
    """record_timeline stamps every TIMELINE_EVENTS point once (tools/walk_timeline.py reads them); the
    walk the op runs reads no clock."""
    from flashqla.hopper.fused_forward import TIMELINE_EVENTS, compile_fused_forward

    plain = compile_fused_forward(128, store_chunk_states=True).get_kernel_source()
    recording = compile_fused_forward(128, store_chunk_states=True, record_timeline=True).get_kernel_source()
    assert "clock64" not in plain
    assert recording.count("clock64()") == sum(len(events) for events in TIMELINE_EVENTS.values())
