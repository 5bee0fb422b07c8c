"""engine.Runner: repeated calls of one shape keep the state (and on CUDA the captured rounds) and give
what fresh generate() calls give, whatever ran before; its argument errors."""

from __future__ import annotations

import pytest

from kdtree_engine.engine import GenerationConfig, Runner, SamplingParams, generate, loop
from kdtree_engine.model import context
from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("method", ["ddtree", "dflash", "autoregressive"])
def test_repeated_calls_equal_fresh_calls(monkeypatch, method, pipelined):
    """Three calls with other prompts (ragged, up to prompt_len) on one Runner: each equals a fresh
    generate() of its prompts, tokens and stats, although the caches hold the last call's rows."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    target = tiny_target(2)
    drafter = None if method == "autoregressive" else tiny_drafter(2, block_size=6)
    config = GenerationConfig(max_new_tokens=14, method=method, budget=8)
    runner = Runner(target, drafter, config, batch_size=3, prompt_len=9)
    for seed, lengths in [(1, [9, 2, 5]), (2, [3, 3, 3]), (3, [1, 8, 6])]:
        prompts = random_prompts(seed, lengths, target.config.vocab_size)
        got, want = runner.generate(prompts), generate(target, drafter, prompts, config)
        assert got.tokens == want.tokens
        assert (got.stats.rounds, got.stats.accept_lengths) == (want.stats.rounds, want.stats.accept_lengths)


@pytest.mark.parametrize("method,budget", [("autoregressive", None), ("ddtree", 8), ("ddtree", "auto")])
def test_the_cache_tells_the_attention_the_rows_in_use_not_the_margins(monkeypatch, method, budget):
    """A Runner's cache holds margins past prompt + limit (a tree written and not kept, rounds enqueued
    ahead): its rows_hint is the prompt length plus the limit, which every forward hands the attention
    plan with its own t added (plan_attention's length_hint: the split count), the same for every
    method."""
    hints = []
    plan = context.plan_attention

    def recording(*args, **kwargs):
        hints.append((args[0].shape[1], kwargs.get("length_hint")))
        return plan(*args, **kwargs)

    monkeypatch.setattr(context, "plan_attention", recording)
    target = tiny_target(0)
    drafter = None if method == "autoregressive" else tiny_drafter(0, block_size=6)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=14, method=method, budget=budget),
                    batch_size=2, prompt_len=9)  # fmt: skip
    runner.generate(random_prompts(1, [9, 4], target.config.vocab_size))
    cache = runner._state.cache
    assert cache.rows_hint == 9 + 14 < cache.max_len
    assert hints and all(hint == 9 + 14 + t for t, hint in hints)


def test_sampled_calls_draw_as_fresh_calls():
    """Sampled tokens depend on the drafts (which node a draw accepts), so a drafter cache or a draw
    counter left from the call before shows here: the second call, after one on other prompts, draws
    what a fresh call draws."""
    target, drafter = tiny_target(1), tiny_drafter(1, block_size=6)
    config = GenerationConfig(max_new_tokens=16, budget=6, seed=5, sampling=SamplingParams(temperature=1.0))
    first, second = (random_prompts(seed, [4, 7], target.config.vocab_size) for seed in (4, 9))
    runner = Runner(target, drafter, config, batch_size=2, prompt_len=7)
    runner.generate(first)
    assert runner.generate(second).tokens == generate(target, drafter, second, config).tokens


@pytest.mark.parametrize(
    "kw,call,match",
    [
        ({"batch_size": 0, "prompt_len": 4}, None, "^batch_size: expected an int >= 1"),
        ({"batch_size": 2, "prompt_len": 2.5}, None, "^prompt_len: expected an int >= 1"),
        ({"batch_size": 2, "prompt_len": 4}, [[1, 2]], "^prompts: this Runner takes 2 prompts"),
        ({"batch_size": 2, "prompt_len": 4}, [[1, 2], [1, 2, 3, 4, 5]], "^prompts: a prompt of 5 tokens"),
    ],
)
def test_runner_errors_name_the_argument(kw, call, match):
    target = tiny_target(0)
    config = GenerationConfig(max_new_tokens=4, method="autoregressive")
    with pytest.raises(ValueError, match=match):
        Runner(target, None, config, **kw).generate(call)
