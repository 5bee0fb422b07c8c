"""The invariant on CUDA: greedy DDTree == greedy DFlash == greedy autoregressive with the GPU kernels
(impl=None picks them on CUDA) and with the reference ops on the same device, float32. bf16 is run too
and its agreement reported (bf16 verify of N tokens and decode of 1 token round differently, so exact
equality is not a bf16 property). Stats go to $OUT/engine_gpu.txt when OUT is set."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.engine import GenerationConfig, SamplingParams, generate
from kdtree_engine.model import greedy_generate, random_model, tiny_config
from tests.engine.helpers import (
    OracleDrafter,
    pick_only_at_the_end,
    pick_sequence,
    random_prompts,
    report_line,
)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _models(dtype, seed=0):
    target = random_model(tiny_config(), seed=seed, dtype=dtype, device=DEVICE)
    cfg = tiny_drafter_config(target.config, block_size=16)
    return target, random_drafter(cfg, seed=seed + 1, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("impl", [None, "ref"], ids=["kernels", "ref"])
@pytest.mark.parametrize("seed", [0])
def test_invariant_cuda_float32(impl, seed):
    target, drafter = _models(torch.float32, seed)
    prompts = random_prompts(seed, [7, 30, 1, 12], target.config.vocab_size)
    n = 40
    expected = greedy_generate(target, prompts, n, impl=impl)
    for method, budget in [("autoregressive", None), ("dflash", None)] + [
        ("ddtree", b) for b in (1, 4, 16, 32)
    ]:
        config = GenerationConfig(max_new_tokens=n, method=method, budget=budget, impl=impl)
        out = generate(target, drafter, prompts, config)
        assert out.tokens == expected, (method, budget)
        report_line(f"cuda fp32 impl={impl} seed={seed} budget={budget}: {out.stats.summary()}")


def test_oracle_forward_counts_cuda():
    target, _ = _models(torch.float32)
    prompts = random_prompts(3, [5, 9], target.config.vocab_size)
    n = 33  # 1 from the prefill + 2 rounds of 16
    drafter = OracleDrafter(target, prompts, n, block_size=16, top=1)
    out = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=n, method="ddtree", budget=32))
    assert out.tokens == greedy_generate(target, prompts, n)
    assert out.stats.target_forwards == 3
    report_line(f"cuda oracle: {out.stats.summary()}")


def test_bf16_and_sampled_run_cuda():
    target, drafter = _models(torch.bfloat16)
    prompts = random_prompts(4, [6, 20], target.config.vocab_size)
    n = 64
    base = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=n, method="autoregressive"))
    config = GenerationConfig(max_new_tokens=n, method="ddtree", budget=32)
    tree = generate(target, drafter, prompts, config)
    pairs = zip(base.tokens, tree.tokens)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in pairs]
    report_line(f"cuda bf16: first divergence from autoregressive at {agree} of {n}; {tree.stats.summary()}")
    assert all(len(t) == n for t in tree.tokens)
    hot = replace(config, sampling=SamplingParams(temperature=0.8, top_p=0.95))
    sampled = generate(target, drafter, prompts, hot)
    assert [len(t) for t in sampled.tokens] == [n, n]
    report_line(f"cuda bf16 sampled: {sampled.stats.summary()}")


@pytest.mark.parametrize(
    "method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 8), ("ddtree", 32)]
)
def test_cuda_graphs_equal_eager_and_autoregressive(method, budget):
    """Rounds replayed from CUDA graphs commit the same tokens as eager rounds and as plain greedy
    decoding (float32, kernels), with a device-resident stand-in drafter captured with the round."""
    from kdtree_engine.engine.demo import demo_drafter

    target, _ = _models(torch.float32)
    prompts = random_prompts(5, [7, 30, 1, 12], target.config.vocab_size)
    n = 40
    expected = greedy_generate(target, prompts, n)
    drafter = demo_drafter("oracle", target, prompts, n)
    outs = {}
    for graphs in (False, True):
        config = GenerationConfig(max_new_tokens=n, method=method, budget=budget, cuda_graphs=graphs)
        outs[graphs] = generate(target, drafter, prompts, config)
        assert outs[graphs].stats.cuda_graphs == graphs
    assert outs[True].tokens == outs[False].tokens == expected
    assert outs[True].stats.target_forwards == outs[False].stats.target_forwards
    report_line(f"cuda graphs {method} {budget}: {outs[True].stats.summary()}")


def test_cuda_graphs_with_an_eager_drafter_and_sampling():
    """A drafter that cannot be captured (the DFlash drafter reads lengths on the host) runs eagerly
    between replayed stages; sampled accept runs eagerly too. Same tokens as fully eager rounds."""
    target, drafter = _models(torch.float32)
    prompts = random_prompts(6, [9, 4], target.config.vocab_size)
    hot = SamplingParams(temperature=0.9, top_p=0.9)
    for sampling in (SamplingParams(), hot):
        runs = [
            generate(target, drafter, prompts, GenerationConfig(
                max_new_tokens=24, method="ddtree", budget=16, sampling=sampling, seed=3, cuda_graphs=g))
            for g in (False, True)
        ]  # fmt: skip
        assert runs[0].tokens == runs[1].tokens


def test_no_memory_growth_over_10000_rounds():
    """10,000 replayed rounds (budget 0: one token per round) allocate nothing after the first ones."""
    from kdtree_engine.engine.demo import NoisyOracleDrafter

    cfg = tiny_config(max_position_embeddings=16384)
    target = random_model(cfg, seed=0, dtype=torch.float32, device=DEVICE)
    prompts = random_prompts(7, [5, 3], cfg.vocab_size)
    drafter = NoisyOracleDrafter(prompts, cfg.vocab_size, block_size=4, device=DEVICE)
    seen = {}

    def sample(b, tokens):
        if b == 0:
            count = seen.setdefault("tokens", 0) + len(tokens)
            seen["tokens"] = count
            seen.setdefault(count >= 100, torch.cuda.memory_allocated())
            seen["last"] = torch.cuda.memory_allocated()

    config = GenerationConfig(max_new_tokens=10_000, method="ddtree", budget=0, cuda_graphs=True)
    out = generate(target, drafter, prompts, config, on_tokens=sample, stage_timing=False)
    assert out.stats.rounds >= 9_999
    assert seen["last"] == seen[True], (seen[True], seen["last"])


def test_stream_keys_draw_the_same_tokens_as_seed_and_offset():
    from kdtree_engine.ref.sampling import stream_key_table
    from kdtree_engine.tree import accept_sampled, build_tree_from_logits

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tree = build_tree_from_logits(torch.randn(3, 5, 300, device=DEVICE, generator=gen), 8)
    logits = torch.randn(3, 9, 300, device=DEVICE, generator=gen)
    table = stream_key_table(12345, 4).to(DEVICE)
    for offset in range(4):
        want = accept_sampled(tree, logits, temperature=0.8, top_p=0.9, seed=12345, offset=offset)[1]
        got = accept_sampled(tree, logits, temperature=0.8, top_p=0.9, stream_keys=table[offset])[1]
        assert torch.equal(got, want)


def test_a_runners_captured_draws_follow_its_seed_across_calls():
    """The captured sampled accept reads its draw's keys from a table on the device, built once per
    seed: a Runner's later calls, on the same seed and then on another, draw what a fresh call with
    that seed draws."""
    from kdtree_engine.engine import Runner

    target, drafter = _models(torch.float32, seed=4)
    prompts = random_prompts(4, [4, 7], target.config.vocab_size)
    config = GenerationConfig(max_new_tokens=24, budget=6, seed=5, sampling=SamplingParams(temperature=1.0))
    runner = Runner(target, drafter, config, batch_size=2, prompt_len=7)
    first = runner.generate(prompts).tokens
    assert runner.generate(prompts).tokens == first == generate(target, drafter, prompts, config).tokens
    runner.config = other = replace(config, seed=6)
    drawn = runner.generate(prompts).tokens
    assert drawn == generate(target, drafter, prompts, other).tokens and drawn != first


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_runner_replays_later_calls_from_their_first_round_cuda(temperature):
    """A Runner's later calls replay the captured rounds (no capture, the first draft eager) and give a
    fresh generate()'s tokens: greedy and sampled (the key table and draw counter of the captured
    accept are reset per call)."""
    from kdtree_engine.engine import Runner

    target, drafter = _models(torch.float32, seed=3)
    sampling = SamplingParams(temperature=temperature)
    config = GenerationConfig(max_new_tokens=40, budget=16, seed=11, sampling=sampling)
    runner = Runner(target, drafter, config, batch_size=3, prompt_len=20)
    # every call's prompts pad to the same prefill width (20): a later call captures nothing
    for seed, lengths in [(1, [20, 4, 9]), (2, [5, 17, 1]), (3, [8, 18, 8])]:
        prompts = random_prompts(seed, lengths, target.config.vocab_size)
        got = runner.generate(prompts)
        assert got.tokens == generate(target, drafter, prompts, config).tokens
        assert got.stats.cuda_graphs
        if seed > 1:
            assert got.stats.capture_time == 0.0


def test_auto_budget_graphs_equal_eager_and_autoregressive(monkeypatch):
    """Budget "auto" on CUDA with a scripted choice that visits every bucket, autoregressive steps
    between speculative rounds (the draft then reads the whole context buffer, its own graph) and
    speculative rounds in a row (the half buffer): replayed rounds commit what eager rounds and plain
    greedy decoding do (float32, kernels, a real drafter), and every bucket's stages were captured."""
    from kdtree_engine.engine import Runner
    from kdtree_engine.engine.budget import BudgetPolicy, auto_buckets

    script = itertools.cycle([4, 0, 0, 8, 16, 16, 0, 32, 64, 64, 0, 8, 15, 4])  # 15: the chain
    real_pick = BudgetPolicy.pick

    def scripted(self, active, must_draft, remaining=None):
        real_pick(self, active, must_draft, remaining)  # the policy's bookkeeping (one choice a round)
        k = next(script)
        return max(k, 4) if must_draft else k

    monkeypatch.setattr(BudgetPolicy, "pick", scripted)
    target, drafter = _models(torch.float32, seed=5)
    prompts = random_prompts(6, [9, 21, 3], target.config.vocab_size)
    n = 60
    expected = greedy_generate(target, prompts, n)
    outs = {}
    for graphs in (False, True):
        config = GenerationConfig(max_new_tokens=n, budget="auto", cuda_graphs=graphs)
        runner = Runner(target, drafter, config, batch_size=3, prompt_len=21)
        outs[graphs] = runner.generate(prompts)
        assert outs[graphs].stats.cuda_graphs == graphs
        if graphs:
            keys = set(runner._rounds.graphs.graphs)
            assert {f"verify@{k}" for k in auto_buckets(15)} <= keys and {"draft", "draft_wide"} <= keys
    assert outs[True].tokens == outs[False].tokens == expected
    assert set(outs[True].stats.budgets) == set(auto_buckets(15))
    report_line(f"cuda graphs auto: {outs[True].stats.summary()}")


def test_auto_budget_captures_a_round_first_run_at_a_calls_end(monkeypatch):
    """A bucket first picked for a call's last round is captured after it (the call over, its requests
    done): the Runner's next call replays it, runs no eager round and commits plain greedy decoding's
    tokens."""
    from kdtree_engine.engine import Runner
    from kdtree_engine.engine.budget import BudgetPolicy

    monkeypatch.setattr(BudgetPolicy, "pick", pick_only_at_the_end(32))
    target, drafter = _models(torch.float32, seed=7)
    prompts = random_prompts(9, [12, 5], target.config.vocab_size)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=30, budget="auto"), batch_size=2,
                    prompt_len=12)  # fmt: skip
    outs = [runner.generate(prompts, stage_timing=False) for _ in range(2)]
    assert "verify@32" in runner._rounds.graphs.graphs
    assert outs[1].stats.eager_rounds == 0 and outs[1].stats.capture_time == 0.0
    assert outs[0].tokens == outs[1].tokens == greedy_generate(target, prompts, 30)


def test_a_runner_captures_every_round_after_its_first_call(monkeypatch):
    """After a first call that picked bucket 4 alone, a Runner's second call picks every bucket, steps
    after drafts and plain decoding's steps, runs no eager round, captures nothing, and commits plain
    greedy decoding's tokens (CUDA graphs captured after the first call, the requests done)."""
    from kdtree_engine.engine import Runner
    from kdtree_engine.engine.budget import BudgetPolicy, auto_buckets

    target, drafter = _models(torch.float32, seed=7)
    prompts = random_prompts(9, [12, 5], target.config.vocab_size)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=40, budget="auto"), batch_size=2,
                    prompt_len=12)  # fmt: skip
    monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([4]))
    first = runner.generate(prompts, stage_timing=False)
    monkeypatch.setattr(
        BudgetPolicy, "pick", pick_sequence([8, 0, 0, 16, 32, 0, 64, 15, 4], stepping_from=10)
    )
    second = runner.generate(prompts, stage_timing=False)
    assert set(first.stats.budgets) == {4} and set(second.stats.budgets) == set(auto_buckets(15))
    assert second.stats.eager_rounds == 0 and second.stats.capture_time == 0.0
    assert first.tokens == second.tokens == greedy_generate(target, prompts, 40)


@pytest.mark.parametrize("budget", [8, "auto"])
def test_a_runner_replays_its_prefill_graphs(budget, monkeypatch):
    """A Runner's prefill is captured per padded width after its first prefill and replayed with each
    later call's own prompts, and so is the first draft over its features: calls of widths 16, 32, 16
    commit plain greedy decoding's tokens, the third captures nothing and runs no round eagerly; a
    sampled Runner draws the same tokens from its eager and its replayed prefill (with budget "auto"
    both calls' rounds scripted to the same buckets: a Runner's measured costs and calibration carry
    over to its later calls, and a sampled run repeats only where its choices do)."""
    from kdtree_engine.engine import Runner

    target, drafter = _models(torch.float32, seed=3)
    vocab = target.config.vocab_size
    calls = [
        random_prompts(1, [5, 11], vocab),
        random_prompts(2, [20, 3], vocab),
        random_prompts(3, [9, 2], vocab),
    ]
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=24, budget=budget), batch_size=2,
                    prompt_len=40)  # fmt: skip
    outs = [runner.generate(prompts, stage_timing=False) for prompts in calls]
    for prompts, out in zip(calls, outs, strict=True):
        assert out.tokens == greedy_generate(target, prompts, 24)
    assert sorted(runner._prefills.graphs) == [16, 32] and outs[2].stats.capture_time == 0.0
    assert "draft@prompts16" in runner._rounds.graphs.graphs and outs[2].stats.eager_rounds == 0
    sampled = GenerationConfig(
        max_new_tokens=24, budget=budget, seed=5, sampling=SamplingParams(temperature=1.0)
    )
    from kdtree_engine.engine.budget import BudgetPolicy

    runner = Runner(target, drafter, sampled, batch_size=2, prompt_len=40)
    runs = []
    for _ in range(2):
        if budget == "auto":
            monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([8, 0, 16, 15, 4]))
        runs.append(runner.generate(calls[0], stage_timing=False))
    assert runs[0].tokens == runs[1].tokens
