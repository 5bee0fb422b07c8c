"""Bad input gets a ValueError that names the argument: GenerationConfig checks itself at construction,
generate() checks what needs the models (drafter, prompts, stop ids inside the vocabulary)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.engine import GenerationConfig, SamplingParams, generate
from tests.engine.helpers import tiny_drafter, tiny_target


def _models():
    return tiny_target(0), tiny_drafter(0)


def _drafter(**overrides):
    target = tiny_target(0)
    return random_drafter(tiny_drafter_config(target.config, **overrides))


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(budget=-1), r"budget: expected None, 'auto' or an int in \[0, 1048576\] for method 'ddtree'"),
        (dict(budget="all"), r"budget: expected None, 'auto' or an int in \[0, 1048576\] .* got 'all'"),
        (dict(budget=2**62), r"budget: expected None, 'auto' or an int in \[0, 1048576\]"),
        (dict(stop_strings="STOP"), "stop_strings: expected a tuple or list of strings"),
        (dict(stop_strings=("",)), "stop_strings: expected non-empty strings"),
        (dict(stop_strings=(3,)), "stop_strings: expected non-empty strings"),
        (dict(budget=2.0), "budget"),
        (dict(budget=True), "budget"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(max_new_tokens=None), "max_new_tokens"),
        (dict(method="beam"), "method"),
        (dict(sampling=0.5), "sampling: expected a SamplingParams"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed="7"), "seed"),
        (dict(stop_tokens=[-1]), "stop_tokens"),
        (dict(stop_tokens=7), "stop_tokens"),
        (dict(stop_tokens=[1.5]), "stop_tokens"),
        (dict(impl="cuda"), r"impl: expected one of \('ref', 'triton', 'hopper'\) or None, got 'cuda'"),
    ],
)
def test_bad_config(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**{"max_new_tokens": 4, **fields})


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
    ],
)
def test_bad_sampling(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_config_is_frozen_and_normalized():
    config = GenerationConfig(max_new_tokens=4, stop_tokens=[3, 5], sampling=SamplingParams(1, top_k=5))
    assert config.stop_tokens == (3, 5) and config.method == "ddtree" and config.budget == 32
    assert isinstance(config.sampling.temperature, float) and not config.sampling.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget = 3
    assert dataclasses.replace(config, method="dflash").stop_tokens == (3, 5)
    with pytest.raises(TypeError):
        GenerationConfig(4)  # keyword-only
    assert GenerationConfig().max_new_tokens == 64  # the command line's defaults are the config's
    assert GenerationConfig(stop_strings=["a", "b"]).stop_strings == ("a", "b")


def test_tree_budget():
    assert GenerationConfig(max_new_tokens=1, budget=None).tree_budget(8) == 7
    assert GenerationConfig(max_new_tokens=1).tree_budget(8) == 32
    assert GenerationConfig(max_new_tokens=1, budget=0).tree_budget(8) == 0
    assert GenerationConfig(max_new_tokens=1, method="dflash", budget=32).tree_budget(8) == 7
    assert GenerationConfig(max_new_tokens=1, method="autoregressive", budget=32).tree_budget(8) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "prompts"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, 2, 10_000]]), "prompts: prompt 0 has token ids outside"),
        (dict(prompts=[[-1]]), "prompts"),
        (dict(prompts=[[1.5]]), "prompts"),
        (dict(prompts=[[1] * 4096]), "longer than the target's context"),
        (dict(stop_tokens=(10_000,)), "stop_tokens"),
        (dict(drafter=None), "drafter: method 'ddtree' needs a drafter"),
        (dict(config=8), "config: expected a GenerationConfig, got int"),
    ],
)
def test_bad_arguments(kwargs, match):
    target, drafter = _models()
    args = dict(prompts=[[1, 2, 3]], drafter=drafter)
    args.update(kwargs)
    config = args.pop("config", None) or GenerationConfig(
        max_new_tokens=4, budget=4, stop_tokens=args.pop("stop_tokens", ())
    )
    with pytest.raises(ValueError, match=match):
        generate(target, args["drafter"], args["prompts"], config)


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
        generate(target, _drafter(**overrides), [[1, 2, 3]], GenerationConfig(max_new_tokens=4))


def test_autoregressive_needs_no_drafter():
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=3, method="autoregressive")
    assert len(generate(target, None, [[1, 2, 3]], config).tokens[0]) == 3


def test_zero_new_tokens_runs_nothing():
    target, drafter = _models()
    out = generate(target, drafter, [[1, 2], [3]], GenerationConfig(max_new_tokens=0))
    assert out.tokens == [[], []] and out.stats.target_forwards == 0


def test_tensor_and_flat_prompts():
    target, drafter = _models()
    config = GenerationConfig(max_new_tokens=5)
    a = generate(target, drafter, torch.tensor([[4, 5, 6]]), config).tokens
    b = generate(target, drafter, [4, 5, 6], config).tokens
    assert a == b and len(a) == 1


def test_stream_keys_need_cuda_and_exclude_seed():
    import torch

    from kdtree_engine.tree import accept_sampled, build_tree_from_logits

    tree = build_tree_from_logits(torch.randn(1, 2, 10), 2)
    logits = torch.randn(1, 3, 10)
    keys = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="stream_keys: needs CUDA"):
        accept_sampled(tree, logits, temperature=1.0, stream_keys=keys)
    with pytest.raises(ValueError, match="stream_keys: give stream_keys alone"):
        accept_sampled(tree, logits, temperature=1.0, stream_keys=keys, seed=1)
    with pytest.raises(ValueError, match=r"stream_keys: expected a \[2\] int32"):
        accept_sampled(tree, logits, temperature=1.0, stream_keys=keys.long())


def test_cuda_graphs_setting_is_checked():
    with pytest.raises(ValueError, match="cuda_graphs: expected None, True or False"):
        GenerationConfig(max_new_tokens=4, cuda_graphs="yes")
    target, drafter = tiny_target(0), tiny_drafter(0, block_size=4)
    config = GenerationConfig(max_new_tokens=4, method="ddtree", budget=4, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs: needs a CUDA target and a kernel impl"):
        generate(target, drafter, [[1, 2, 3]], config)


def test_row_invariant_setting_is_checked():
    with pytest.raises(ValueError, match="row_invariant: expected True or False"):
        GenerationConfig(max_new_tokens=4, row_invariant="yes")
    target, drafter = tiny_target(0), tiny_drafter(0, block_size=4)
    for impl in ("ref", None):  # None on the CPU is the reference
        config = GenerationConfig(max_new_tokens=4, method="ddtree", budget=4, impl=impl, row_invariant=True)
        with pytest.raises(ValueError, match="row_invariant: needs a kernel impl"):
            generate(target, drafter, [[1, 2, 3]], config)


def test_limits_are_checked_before_any_allocation():
    """A huge max_new_tokens is clamped to the context before the cache is sized; a budget past what a
    tree op builds is refused before anything is allocated (budgets below it whose verify forward
    cannot fit: see test_stops_and_sizes.py)."""
    target, drafter = tiny_target(0), tiny_drafter(0, block_size=4)
    with pytest.raises(ValueError, match=r"^budget: expected an int in \[0, 4096\] \(the most nodes"):
        generate(target, drafter, [[1, 2, 3]], GenerationConfig(max_new_tokens=8, budget=10**6))
    every_id = range(target.config.vocab_size)  # stop after the first token
    config = GenerationConfig(max_new_tokens=10**12, method="ddtree", budget=4, stop_tokens=every_id)
    out = generate(target, drafter, [[1, 2, 3]], config)
    assert len(out.tokens[0]) == 1
