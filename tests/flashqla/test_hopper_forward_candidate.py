"""GPU tests of the forward walk's candidate (`fused_forward(split_state=True)`, bench --compare
forward_halves) before it may replace the walk: the forward grid, the split sequences and the hard
inputs (forward and backward, whose rewalk of the chunk states runs the candidate too), with the
candidate patched in where forward.py calls the walk and every plan made with whole 128-wide V blocks
(the only width the candidate runs), so that the small head layouts run it too. Skipped without an
SM90 GPU.
"""
import pytest

from hopper_grid import HEAD_IDS, HEAD_LAYOUTS, LENGTHS, on_hopper

pytestmark = pytest.mark.gpu

if not on_hopper:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

import test_hopper_forward as forward_tests  # noqa: E402
import test_hopper_hard_inputs as hard_tests  # noqa: E402

from flashqla.hopper import chunk_plan  # noqa: E402
from flashqla.hopper import forward as forward_module  # noqa: E402
from flashqla.hopper.fused_forward import fused_forward  # noqa: E402

VALUE_BLOCK_ARGUMENT = 10  # fused_forward's positional value_block


@pytest.fixture(autouse=True)
def candidate_walk(monkeypatch):
    calls = []

    def candidate(*args, **kwargs):
        calls.append(args[VALUE_BLOCK_ARGUMENT])
        return fused_forward(*args, **kwargs, split_state=True)

    monkeypatch.setattr(forward_module, "fused_forward", candidate)
    # the widest V block a plan allows (the forward's 128, the state-gradient walk's 64)
    monkeypatch.setattr(chunk_plan, "value_block_size", lambda *args, **kwargs: kwargs.get("max_block", args[4]))
    chunk_plan._cached_forward_plan.cache_clear()
    yield
    chunk_plan._cached_forward_plan.cache_clear()
    assert calls and set(calls) == {128}, f"the candidate ran with V blocks {sorted(set(calls))}"


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_IDS)
def test_candidate_forward_matches_float64_reference(heads, lengths, with_initial_state):
    forward_tests.test_forward_matches_float64_reference(heads, lengths, with_initial_state)


def test_candidate_other_dtypes_and_groups():
    forward_tests.test_forward_other_dtypes_and_groups()


@pytest.mark.parametrize("lengths", [[32768], [28672, 4096], [8192] * 4], ids=["1x32768", "28672+4096", "8192x4"])
def test_candidate_split_sequences(lengths):
    forward_tests.test_split_sequences_exact_and_truncated(lengths)


@pytest.mark.parametrize("case", hard_tests.CASES, ids=hard_tests.CASE_IDS)
def test_candidate_hard_inputs_match_float64(case):
    hard_tests.test_hard_inputs_match_float64(case)
