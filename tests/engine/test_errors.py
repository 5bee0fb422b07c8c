"""Bad input gets a ValueError that names the argument."""

from __future__ import annotations

import pytest

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.engine import generate
from tests.engine.helpers import tiny_drafter, tiny_target


def _models():
    return tiny_target(0), tiny_drafter(0)


def _drafter(**overrides):
    target = tiny_target(0)
    return random_drafter(tiny_drafter_config(target.config, **overrides))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "prompts"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, 2, 10_000]]), "prompts: prompt 0 has token ids outside"),
        (dict(prompts=[[-1]]), "prompts"),
        (dict(prompts=[[1.5]]), "prompts"),
        (dict(prompts=[[1] * 4096]), "longer than the target's context"),
        (dict(budget=-1), "budget"),
        (dict(budget=2.0), "budget"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(method="beam"), "method"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop_tokens=[10_000]), "stop_tokens"),
        (dict(drafter=None), "drafter: method 'ddtree' needs a drafter"),
    ],
)
def test_bad_arguments(kwargs, match):
    target, drafter = _models()
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4, drafter=drafter, budget=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(target, args.pop("drafter"), args.pop("prompts"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_size=48), "hidden_size 48 != target hidden_size 32"),
        (dict(vocab_size=200, mask_token_id=5), "vocab_size 200 != target vocab_size 96"),
        (dict(target_layer_ids=(0, 3)), r"target_layer_ids \[3\] out of range for a target with 3 layers"),
        (dict(target_layer_ids=(-1,)), "target_layer_ids"),
    ],
)
def test_mismatched_drafter(overrides, match):
    target = tiny_target(0)
    with pytest.raises(ValueError, match=f"drafter: {match}"):
        generate(target, _drafter(**overrides), [[1, 2, 3]], 4, method="ddtree")


def test_autoregressive_needs_no_drafter():
    target = tiny_target(0)
    assert len(generate(target, None, [[1, 2, 3]], 3, method="autoregressive").tokens[0]) == 3


def test_zero_new_tokens_runs_nothing():
    target, drafter = _models()
    out = generate(target, drafter, [[1, 2], [3]], 0)
    assert out.tokens == [[], []] and out.stats.target_forwards == 0


def test_tensor_and_flat_prompts():
    import torch

    target, drafter = _models()
    a = generate(target, drafter, torch.tensor([[4, 5, 6]]), 5).tokens
    b = generate(target, drafter, [4, 5, 6], 5).tokens
    assert a == b and len(a) == 1
