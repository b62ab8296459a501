"""Shared by every test folder: the helper modules beside the tests (hopper_grid, model_fixtures,
train_runs) import by name because pytest puts each test's folder on sys.path; tests marked `gpu`
skip on a machine without CUDA, so no GPU test needs its own skip for that."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
