"""tests/model: one intra-op thread. The models here are tiny, and on a shared 2-core machine a second
thread makes every small op wait for the other thread (measured 5-10x slower under load)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
