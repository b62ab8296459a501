"""train.zero_step against DeepSpeed's own ZeRO-2 gradient checks and a float64 norm (CPU, one and
two gloo ranks: the norm's all-reduce and a bad gradient on one rank skipping the step on all)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from train.zero_step import streamline_zero_step

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def cases(request, tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("zero_step")
    launcher = [sys.executable] if request.param == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={request.param}"]
    result = subprocess.run(launcher + [str(HERE / "zero_step_run.py")], capture_output=True, text=True,
                            timeout=300, cwd=workdir)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    without_norm = rows.pop(0)["without_norm"]
    assert len(rows) == 12 and all(r["world"] == request.param for r in rows)
    return {"without_norm": without_norm, **{(r["dtype"], r["streamlined"], r["poison"]): r for r in rows}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_pass_norm_matches_deepspeeds_and_float64(cases, dtype):
    ours, theirs = cases[dtype, True, "none"], cases[dtype, False, "none"]
    assert ours["reason"] is None  # streamlined: both methods replaced
    assert not ours["skipped_steps"] and ours["changed"] and ours["finite"]
    assert ours["norm"] == pytest.approx(theirs["norm"], rel=2e-6)
    # the gradients themselves are float32 or bf16; the float64 norm is of the float64 model's
    assert ours["norm"] == pytest.approx(ours["reference_norm"], rel=1e-6 if dtype == "float32" else 2e-3)
    # the clip factor agrees to float32 rounding, so the updated weights do (bf16: to one rounding)
    tolerance = 1e-6 if dtype == "float32" else 8e-3
    for a, b in zip(ours["params"], theirs["params"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= tolerance


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_non_finite_gradient_still_skips_the_step(cases, dtype, poison):
    for streamlined in (False, True):  # DeepSpeed's own checks skip it too: the test can tell
        row = cases[dtype, streamlined, poison]
        assert row["skipped_steps"] == 1 and not row["changed"] and row["finite"], row
        assert math.isinf(row["norm"])


def test_without_a_gradient_norm_the_overflow_check_stays(cases):
    # the norm is what skips a non-finite step once the per-tensor check is gone
    assert "compute_grad_norm=false" in cases["without_norm"]


def test_other_optimizers_are_left_alone():
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    reason = streamline_zero_step(optimizer)
    assert "SGD" in reason and "ZeRO-1/2" in reason
    assert not hasattr(optimizer, "get_grad_norm_direct")
