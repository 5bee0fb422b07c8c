"""engine.prefill: a Runner's prefill padded to a few widths and replayed from a graph per width after
its first, eager, prefill (graphs stood in for on the CPU: the bookkeeping, the static inputs and the
padding; the GPU twin is in test_gpu.py); one generate() call stays eager at the longest prompt."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, Runner, generate, loop
from kdtree_engine.engine import stages as round_stages
from kdtree_engine.engine.prefill import prefill_width
from kdtree_engine.model import greedy_generate
from kdtree_engine.model.greedy import pad_prompts
from tests.engine.helpers import HostPrefillGraphs, random_prompts, tiny_drafter, tiny_target


def test_widths_are_powers_of_two_from_16_capped_at_the_runners_prompt_len():
    assert [prefill_width(n, 100) for n in (1, 5, 16, 17, 33, 64, 65, 100)] == [
        16,
        16,
        16,
        32,
        64,
        64,
        100,
        100,
    ]
    assert prefill_width(3, 8) == 8 and prefill_width(8, 8) == 8


def test_padding_to_a_width_keeps_the_prompts_and_names_a_short_width():
    ids, lens = pad_prompts([[5, 6, 7], [9]], "cpu", width=6)
    assert ids.tolist() == [[5, 6, 7, 0, 0, 0], [9, 0, 0, 0, 0, 0]] and lens.tolist() == [3, 1]
    with pytest.raises(ValueError, match="width"):
        pad_prompts([[5, 6, 7]], "cpu", width=2)


@pytest.fixture
def stood_in(monkeypatch):
    """Graphs on (stood in for on the CPU) for the prefill and the rounds."""
    from tests.engine.test_auto_budget import _RecordedGraphs

    monkeypatch.setattr(round_stages, "use_graphs", lambda run, device: True)
    monkeypatch.setattr(loop, "_Graphs", _RecordedGraphs)
    monkeypatch.setattr(loop, "PrefillGraphs", HostPrefillGraphs)


@pytest.mark.parametrize(
    "method, budget", [("autoregressive", None), ("ddtree", 8), ("ddtree", "auto"), ("dflash", None)]
)
def test_a_runner_replays_the_prefill_of_each_width_after_its_first(stood_in, method, budget):
    """Calls of widths 16, 32, 16: the first of each width prefills eagerly and captures, the third
    replays width 16's prefill with its own prompts; every call commits plain greedy decoding's tokens."""
    target, drafter = tiny_target(2), tiny_drafter(2, block_size=6)
    vocab = target.config.vocab_size
    calls = [
        random_prompts(1, [5, 11], vocab),
        random_prompts(2, [20, 3], vocab),
        random_prompts(3, [9, 2], vocab),
    ]
    config = GenerationConfig(max_new_tokens=12, method=method, budget=budget)
    runner = Runner(
        target, drafter if method != "autoregressive" else None, config, batch_size=2, prompt_len=40
    )
    outs = [runner.generate(prompts, stage_timing=False) for prompts in calls]
    for prompts, out in zip(calls, outs, strict=True):
        assert out.tokens == greedy_generate(target, prompts, 12)
    graphs = runner._prefills.graphs
    assert sorted(graphs) == [16, 32] and graphs[16].replays == 1 and graphs[32].replays == 0
    assert graphs[16].ids[:, :9].tolist()[0] == calls[2][0]  # the replayed call's prompt, padded
    assert outs[2].stats.capture_time == 0.0 and outs[2].stats.eager_rounds == 0
    if method != "autoregressive":  # the first draft of width 16 captured after the first call
        assert "draft@prompts16" in runner._rounds.graphs.graphs


def test_a_replayed_first_draft_reads_the_calls_own_prompt_features(stood_in, monkeypatch):
    """The first draft of a call whose prefill was replayed (its stage captured, bound to the prefill
    graph's output) sees the same prompt features as a lone generate() call of those prompts."""
    target, drafter = tiny_target(2), tiny_drafter(2, block_size=6)
    seen = []
    real = type(drafter).draft

    def spy(self, target, context, context_lens, *args, **kw):
        seen.append([context[i, :n].clone() for i, n in enumerate(context_lens.tolist())])
        return real(self, target, context, context_lens, *args, **kw)

    monkeypatch.setattr(type(drafter), "draft", spy)
    vocab = target.config.vocab_size
    calls = [random_prompts(6, [5, 11], vocab), random_prompts(7, [9, 2], vocab)]
    config = GenerationConfig(max_new_tokens=8, budget=8)
    runner = Runner(target, drafter, config, batch_size=2, prompt_len=16)
    runner.generate(calls[0], stage_timing=False)
    seen.clear()
    runner.generate(calls[1], stage_timing=False)  # width 16 replayed, its first draft too
    replayed = seen[0]
    seen.clear()
    generate(target, drafter, calls[1], config, stage_timing=False)
    for got, want in zip(replayed, seen[0], strict=True):
        torch.testing.assert_close(got, want)


def test_one_generate_call_prefills_eagerly_at_the_longest_prompt(stood_in, monkeypatch):
    """generate() makes one call: no prefill graph is worth capturing, the prompts are padded to the
    longest only."""
    seen = []
    real = loop._prefill

    def spy(run, prompts, state=None, graphs=None, width=None, while_running=None):
        seen.append((graphs, width))
        return real(run, prompts, state, graphs, width, while_running)

    monkeypatch.setattr(loop, "_prefill", spy)
    HostPrefillGraphs.captures = 0
    target = tiny_target(2)
    prompts = random_prompts(5, [7, 12], target.config.vocab_size)
    out = generate(target, None, prompts, GenerationConfig(max_new_tokens=6, method="autoregressive"))
    assert out.tokens == greedy_generate(target, prompts, 6)
    assert seen == [(None, None)] and HostPrefillGraphs.captures == 0
