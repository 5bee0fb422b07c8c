"""The engine through the Triton kernels (tree build / compile / accept and the MLA attention) on the
CPU, in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA): the same
greedy outputs as the reference path. Tiny on purpose: the interpreter is slow. On CUDA machines the
gpu tests cover the kernels instead."""

from __future__ import annotations

import copy

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
    for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", "auto")):
        config = GenerationConfig(max_new_tokens=4, method=method, budget=budget, impl="triton")
        out = generate(target, drafter, prompts, config)
        assert out.tokens == expected, (method, budget)


def test_row_invariant_mode_reaches_every_target_forward_and_keeps_greedy_outputs(monkeypatch):
    """GenerationConfig(row_invariant=True): every target forward of the call (prefill, verify, decode)
    runs with it, and greedy DDTree and DFlash give the autoregressive tokens in bf16 through the
    kernels (the model-level bit equality is tests/model/test_row_invariance.py)."""
    pytest.importorskip("triton")
    # copies: tiny_target and tiny_drafter are cached, shared by other tests in float32
    target, drafter = (
        copy.deepcopy(tiny_target(0)).bfloat16(),
        copy.deepcopy(tiny_drafter(0, block_size=4)).bfloat16(),
    )
    seen = []
    forward = type(target).forward

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("row_invariant", False))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", recording)
    prompts = random_prompts(1, [3, 7], target.config.vocab_size)
    outputs = {}
    for method, budget in (("autoregressive", None), ("dflash", None), ("ddtree", 4)):
        config = GenerationConfig(
            max_new_tokens=5, method=method, budget=budget, impl="triton", row_invariant=True
        )
        outputs[method] = generate(
            target, drafter if method != "autoregressive" else None, prompts, config
        ).tokens
    assert seen and all(seen)
    assert outputs["dflash"] == outputs["autoregressive"] and outputs["ddtree"] == outputs["autoregressive"]
