"""Sampled DDTree decoding draws from the target's distribution: chi-square tests on a 16-token vocabulary
over many draws (a batch of identical prompts, fixed seed, so the test is deterministic), at alpha = 1e-6
so that a correct sampler cannot flake, and checks that deliberately wrong samplers ARE rejected."""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.engine import GenerationConfig, SamplingParams, generate, target_probs
from kdtree_engine.engine import stages as round_stages
from kdtree_engine.model import random_model, tiny_config
from kdtree_engine.tree import accept_greedy, accept_sampled

V, PROMPT, DRAWS, BUDGET = 16, [3, 5, 7], 1500, 24  # BUDGET > V: every root sample has a child


@lru_cache(maxsize=1)
def _models():
    target = random_model(tiny_config(vocab_size=V, hidden_size=32, num_hidden_layers=2), seed=21)
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), seed=22)
    return target, drafter


def _next_probs(target, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """[len(prefixes), V]: the target's sampling distribution after each (equal-length) prefix."""
    ids = torch.tensor(prefixes)
    logits = target(ids, target.new_cache(len(prefixes), ids.shape[1])).logits[:, -1]
    return target_probs(logits, params).double()


@lru_cache(maxsize=4)
def _exact(params: SamplingParams):
    """Exact marginals of the first three sampled tokens: p1 [V], p12 [V, V] joint, p3 [V]."""
    target, _ = _models()
    p1 = _next_probs(target, [PROMPT], params)[0]
    p2 = _next_probs(target, [PROMPT + [a] for a in range(V)], params)  # [V, V] p(t2 | t1)
    p3 = _next_probs(target, [PROMPT + [a, b] for a in range(V) for b in range(V)], params).view(V, V, V)
    p12 = p1[:, None] * p2
    return p1, p12, (p12[..., None] * p3).sum((0, 1))


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expecting < min_expected draws are pooled."""
    counts, expected = counts.flatten().double(), probs.flatten() * counts.sum()
    small = expected < min_expected
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    if bool((counts[~keep] > 0).any()):
        return math.inf, 1
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi2_critical(df: int, z: float = 4.753) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.753 is the normal 1 - 1e-6 quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _draws(params: SamplingParams, seed: int = 1234, method: str = "ddtree") -> torch.Tensor:
    target, drafter = _models()
    config = GenerationConfig(max_new_tokens=3, method=method, budget=BUDGET, sampling=params, seed=seed)
    out = generate(target, drafter, [PROMPT] * DRAWS, config)
    assert all(len(t) == 3 for t in out.tokens)
    assert out.stats.target_forwards <= 4
    return torch.tensor(out.tokens)  # [DRAWS, 3]


def _rejections(draws: torch.Tensor, params: SamplingParams) -> list[str]:
    p1, p12, p3 = _exact(params)
    tests = {
        "t1": (torch.bincount(draws[:, 0], minlength=V), p1),
        "t1,t2": (torch.bincount(draws[:, 0] * V + draws[:, 1], minlength=V * V), p12),
        "t3": (torch.bincount(draws[:, 2], minlength=V), p3),
    }
    failed = []
    for name, (counts, probs) in tests.items():
        stat, df = chi2_statistic(counts, probs)
        if stat > chi2_critical(df):
            failed.append(f"{name}: chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})")
    return failed


PARAMS = [SamplingParams(1.0), SamplingParams(0.8, top_p=0.95, top_k=10)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.8-p0.95-k10"])
def test_ddtree_sampling_matches_target_distribution(params):
    assert _rejections(_draws(params), params) == []


def test_dflash_sampling_matches_target_distribution():
    assert _rejections(_draws(PARAMS[0], seed=99, method="dflash"), PARAMS[0]) == []


def test_sampling_is_reproducible_from_the_seed():
    target, drafter = _models()
    configs = [GenerationConfig(max_new_tokens=12, sampling=SamplingParams(1.0), seed=s) for s in (5, 5, 6)]
    run = [generate(target, drafter, [PROMPT] * 4, c).tokens for c in configs]
    assert run[0] == run[1] and run[0] != run[2]


def test_wrong_samplers_are_rejected(monkeypatch):
    """The same test must reject (a) a mis-tempered sampler and (b) a tree-specific bug: sampling the
    root but taking the argmax at the other nodes (biases the tokens after the first drafted one)."""
    params = PARAMS[0]
    right = round_stages.accept_tokens

    def hot(tree, logits, p, **kw):
        return right(tree, logits, SamplingParams(1.6), **kw)

    def greedy_below_root(tree, logits, p, *, seed, offset, impl=None):
        _, tokens = accept_sampled(tree, logits, temperature=p.temperature, seed=seed, offset=offset)
        tokens[:, 1:] = logits[:, 1:].argmax(-1)
        return accept_greedy(tree, tokens)

    monkeypatch.setattr(round_stages, "accept_tokens", hot)
    assert any(r.startswith("t1:") for r in _rejections(_draws(params), params))
    monkeypatch.setattr(round_stages, "accept_tokens", greedy_below_root)
    bad = _rejections(_draws(params), params)
    assert any(r.startswith("t3:") for r in bad) and not any(r.startswith("t1:") for r in bad)


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(1.0, top_k=2))
    full = torch.softmax(logits[0, :2], -1)
    torch.testing.assert_close(probs[0], torch.cat([full, torch.zeros(3)]))
    # top_p keeps the smallest prefix whose mass reaches p (the token crossing p is kept).
    p = torch.softmax(logits[0], -1)
    kept = target_probs(logits, SamplingParams(1.0, top_p=float(p[0] + 1e-3)))[0]
    assert (kept > 0).tolist() == [True, True, False, False, False]
    assert target_probs(logits, SamplingParams(1.0, top_p=float(p[0] * 0.5)))[0].tolist() == [1, 0, 0, 0, 0]
    hot = target_probs(logits, SamplingParams(0.5))[0]
    torch.testing.assert_close(hot, torch.softmax(logits[0] / 0.5, -1))
