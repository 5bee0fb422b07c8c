"""The pool of target continuations a drafter trains on (kdtree_engine.train.drafter_pool) on a tiny
random target, float32, CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine.model import greedy_generate, random_model, tiny_config
from kdtree_engine.train.drafter_pool import PoolSpec, build_pool, sample_windows

LAYERS = (0, 2)
VOCAB = 128


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(), seed=0).requires_grad_(False)


def _source(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, VOCAB, size=n).astype(np.uint16)


def test_greedy_pool_continues_with_the_target_and_captures_its_features(target):
    source = _source(500, 0)
    spec = PoolSpec(sequences=5, prompt_len=5, new_tokens=6, sampled_fraction=0.0, batch=3)
    pool = build_pool(target, source, spec, LAYERS, seed=7, progress=False)
    assert pool.tokens.shape == (5, 11) and pool.features.shape == (5, 11, 2 * target.config.hidden_size)
    prompts = sample_windows(source, 5, 5, np.random.default_rng(7))
    assert pool.tokens[:, :5].tolist() == prompts.tolist()
    assert pool.tokens[:, 5:].tolist() == greedy_generate(target, prompts.tolist(), 6)
    direct = target(pool.tokens, target.new_cache(5, 11), capture_layers=LAYERS).hidden
    torch.testing.assert_close(pool.features, direct, rtol=1e-5, atol=1e-5)


def test_sampled_pool_rows_are_seeded_draws(target):
    source = _source(500, 1)
    spec = PoolSpec(sequences=4, prompt_len=5, new_tokens=8, sampled_fraction=0.5, batch=4)
    pool = build_pool(target, source, spec, LAYERS, seed=3, progress=False)
    greedy = greedy_generate(target, pool.tokens[:, :5].tolist(), 8)
    new = pool.tokens[:, 5:].tolist()
    assert new[2:] == greedy[2:]  # the rest greedy
    assert new[0] != greedy[0] and new[1] != greedy[1]  # the first half sampled
    again = build_pool(target, source, spec, LAYERS, seed=3, progress=False)
    assert torch.equal(again.tokens, pool.tokens)
