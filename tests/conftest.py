"""Test set-up. Without CUDA, Triton kernels run on the CPU through the Triton interpreter; the variable
must be set before any kernel module is imported, so it is set here."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: CUDA when present, else the CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
