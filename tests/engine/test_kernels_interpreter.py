"""The engine through the Triton kernels (tree build / compile / accept and the MLA attention) on the
CPU, in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA): the same
greedy outputs as the reference path. Tiny on purpose: the interpreter is slow. On CUDA machines the
gpu tests cover the kernels instead."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; CUDA runs test_gpu")


def test_greedy_invariant_through_the_kernels():
    pytest.importorskip("triton")
    target, drafter = tiny_target(0), tiny_drafter(0, block_size=4)
    prompts = random_prompts(0, [3, 6], target.config.vocab_size)
    expected = greedy_generate(target, prompts, 4)
    for method, budget in (("dflash", None), ("ddtree", 4)):
        config = GenerationConfig(max_new_tokens=4, method=method, budget=budget, impl="triton")
        out = generate(target, drafter, prompts, config)
        assert out.tokens == expected, method
