"""Test set-up. Without CUDA, Triton kernels run on the CPU through the Triton interpreter; the variable
must be set before any kernel module is imported, so it is set here."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "golden" in item.path.parts:
            item.add_marker(pytest.mark.golden)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the models and kernels under test are tiny, and on a loaded 2-core CI box a
    second thread makes every small op wait on the other (measured 5-10x slower). Restored after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: CUDA when present, else the CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
