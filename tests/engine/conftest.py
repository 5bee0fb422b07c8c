"""Engine tests run tiny models: one intra-op thread is ~10x faster than two on a loaded 2-core CI box
(threads spin-wait on each other for every small op). Restored after each test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
