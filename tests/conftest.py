"""Shared by every test folder: the helper modules beside the tests (hopper_grid, model_fixtures,
train_runs) import by name because pytest puts each test's folder on sys.path; tests marked `gpu`
skip on a machine without CUDA, so no GPU test needs its own skip for that. With PYTEST_FAILURES_LOG set
(tools/device_session.sh sets it), every failure is appended there as it happens: a device call killed at its
budget keeps the numbers pytest would only have printed in its closing summary."""
import os

import pytest
import torch


def pytest_runtest_logreport(report):
    path = os.environ.get("PYTEST_FAILURES_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
