"""GPU tests of the forward walk's candidate (`fused_forward(delta_builds_ab=True)`, --compare
forward_ab) before it may replace the walk: the forward grid and the hard inputs (forward and
backward, whose rewalk of the chunk states runs the candidate too), with the candidate patched in
where forward.py calls the walk. Skipped without an SM90 GPU.
"""
import functools

import pytest

from hopper_grid import HEAD_IDS, HEAD_LAYOUTS, LENGTHS, on_hopper

pytestmark = pytest.mark.gpu

if not on_hopper:
    pytest.skip("needs an SM90 (Hopper) GPU", allow_module_level=True)

import test_hopper_forward as forward_tests  # noqa: E402
import test_hopper_hard_inputs as hard_tests  # noqa: E402

from flashqla.hopper import forward as forward_module  # noqa: E402
from flashqla.hopper.fused_forward import fused_forward  # noqa: E402


@pytest.fixture(autouse=True)
def candidate_walk(monkeypatch):
    monkeypatch.setattr(forward_module, "fused_forward", functools.partial(fused_forward, delta_builds_ab=True))


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
