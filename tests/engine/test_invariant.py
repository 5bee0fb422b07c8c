"""The invariant: greedy DDTree == greedy DFlash == greedy autoregressive, token for token, on a tiny
random DeepSeek-V3 target (kdtree_engine.model) with a random DFlash drafter, batch 1 and ragged batches."""

from __future__ import annotations

import pytest

from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target

BUDGETS = (1, 4, 16, 32)


def _run(target, drafter, prompts, n, method, budget=None):
    config = GenerationConfig(max_new_tokens=n, method=method, budget=budget, impl="ref")
    return generate(target, drafter, prompts, config)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lengths", [[5], [3, 11, 1]], ids=["batch1", "ragged3"])
def test_greedy_ddtree_equals_dflash_equals_autoregressive(seed, lengths):
    target, drafter = tiny_target(seed), tiny_drafter(seed, seed=100 + seed)
    prompts = random_prompts(seed, lengths, target.config.vocab_size)
    n = 24
    expected = greedy_generate(target, prompts, n)  # the model's own greedy loop
    ar = _run(target, drafter, prompts, n, "autoregressive")
    assert ar.tokens == expected
    assert ar.stats.target_forwards == n
    dflash = _run(target, drafter, prompts, n, "dflash")
    assert dflash.tokens == expected
    for budget in BUDGETS:
        out = _run(target, drafter, prompts, n, "ddtree", budget)
        assert out.tokens == expected, f"budget {budget}"
        assert all(len(t) == n for t in out.tokens)
        rounds = out.stats.target_forwards - 1
        assert out.stats.drafter_forwards == rounds
        assert sum(out.stats.accept_lengths) >= n * len(prompts) - len(prompts)


def test_batched_equals_one_by_one():
    """Ragged acceptance and finished requests leaving the batch: each request of a batch gets what it
    gets alone (ragged acceptance makes requests finish at different rounds)."""
    target, drafter = tiny_target(3), tiny_drafter(3, seed=7)
    prompts = random_prompts(5, [2, 9, 4, 6], target.config.vocab_size)
    batched = _run(target, drafter, prompts, 20, "ddtree", 16)
    alone = [_run(target, drafter, [p], 20, "ddtree", 16) for p in prompts]
    assert batched.tokens == [a.tokens[0] for a in alone]
    # The same trees were accepted (the drafter's cache rows follow their requests as rows are dropped).
    assert sorted(batched.stats.accept_lengths) == sorted(n for a in alone for n in a.stats.accept_lengths)


def test_budget_zero_is_autoregressive_with_a_drafter():
    target, drafter = tiny_target(0), tiny_drafter(0)
    prompts = random_prompts(9, [4, 7], target.config.vocab_size)
    out = _run(target, drafter, prompts, 10, "ddtree", 0)
    assert out.tokens == greedy_generate(target, prompts, 10)
    assert out.stats.target_forwards == 10 and set(out.stats.accept_lengths) == {1}


def test_stop_tokens_and_lengths():
    target, drafter = tiny_target(1), tiny_drafter(1, seed=101)
    prompts = random_prompts(1, [3, 8], target.config.vocab_size)
    full = greedy_generate(target, prompts, 30)
    stop = full[0][12]
    cut = [seq[: seq.index(stop) + 1] if stop in seq else seq for seq in full]
    for method in ("autoregressive", "dflash", "ddtree"):
        config = GenerationConfig(max_new_tokens=30, method=method, budget=8, stop_tokens=[stop])
        out = generate(target, drafter, prompts, config)
        assert out.tokens == cut, method
        assert out.stats.new_tokens == [len(c) for c in cut]


def test_context_limit_stops_generation():
    """A request stops at the target's context (max_position_embeddings) even if max_new_tokens is larger."""
    target = tiny_target(0)
    small = type(target)(target.config.replace(max_position_embeddings=20))
    small.load_state_dict(target.state_dict())
    drafter = tiny_drafter(0)
    prompts = [[1, 2, 3], [4] * 12]
    full = greedy_generate(target, prompts, 17)
    for method in ("autoregressive", "ddtree"):
        config = GenerationConfig(max_new_tokens=40, method=method, budget=16)
        out = generate(small.eval(), drafter, prompts, config)
        assert out.tokens == [full[0][:17], full[1][:8]], method


def test_stats_and_streaming():
    target, drafter = tiny_target(0), tiny_drafter(0)
    prompts = random_prompts(3, [4, 6], target.config.vocab_size)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    config = GenerationConfig(max_new_tokens=15, method="ddtree", budget=32)
    out = generate(target, drafter, prompts, config, on_tokens=lambda b, toks: streamed[b].extend(toks))
    assert [streamed[0], streamed[1]] == out.tokens
    s = out.stats
    assert s.total_new_tokens == 30 and s.batch_size == 2
    assert sum(s.accept_histogram.values()) == len(s.accept_lengths)
    assert 1.0 <= s.mean_accept_len <= drafter.block_size
    for stage in ("prefill", "draft", "tree_build", "compile", "verify", "accept", "commit"):
        assert s.stage_times[stage] > 0, stage
    assert s.tokens_per_s > 0 and "target forwards" in s.summary()


def test_stage_timing_off_changes_nothing_but_the_timers():
    target, drafter = tiny_target(0), tiny_drafter(0)
    prompts = random_prompts(3, [4, 6], target.config.vocab_size)
    config = GenerationConfig(max_new_tokens=12, budget=16)
    timed = generate(target, drafter, prompts, config)
    untimed = generate(target, drafter, prompts, config, stage_timing=False)
    assert untimed.tokens == timed.tokens and untimed.stats.accept_lengths == timed.stats.accept_lengths
    assert not any(untimed.stats.stage_times.values()) and untimed.stats.wall_time > 0
    assert "stages: not timed" in untimed.stats.summary()
