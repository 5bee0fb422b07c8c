"""With a drafter that knows the answer, the number of target forwards must drop exactly as predicted,
and DDTree must recover continuations that a single DFlash chain misses."""

from __future__ import annotations

import math

import pytest

from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import OracleDrafter, random_prompts, tiny_target


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
@pytest.mark.parametrize("lengths", [[6], [2, 9]])
def test_top1_oracle_accepts_whole_blocks(method, lengths):
    target = tiny_target(4)
    prompts = random_prompts(11, lengths, target.config.vocab_size)
    n, block = 25, 8  # 1 token from the prefill, then 3 rounds of L + 1 = 8
    drafter = OracleDrafter(target, prompts, n, block_size=block, top=1)
    out = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=n, method=method, budget=8))
    assert out.tokens == greedy_generate(target, prompts, n)
    assert out.stats.target_forwards == 1 + math.ceil((n - 1) / block) == 4
    assert out.stats.drafter_forwards == 3
    assert out.stats.accept_histogram == {block: 3 * len(prompts)}


def test_rank1_oracle_ddtree_beats_dflash():
    """The true token is always the drafter's SECOND choice, with two near-equal top logits. The DFlash
    chain (argmax) never matches, so it commits 1 token per forward. A best-first DDTree of 32 nodes holds
    the full binary tree of depth 4 (30 nodes; every depth-4 path scores above every depth-5 one) plus 2
    depth-5 nodes of mostly rank-0 paths, so it accepts exactly 4 drafted tokens + the bonus per round."""
    target = tiny_target(5)
    prompts = random_prompts(12, [5, 3], target.config.vocab_size)
    n = 21
    expected = greedy_generate(target, prompts, n)

    def oracle():
        return OracleDrafter(target, prompts, n, block_size=8, rank=lambda pos: 1, top=2, margin=0.1)

    chain = generate(target, oracle(), prompts, GenerationConfig(max_new_tokens=n, method="dflash"))
    tree = generate(target, oracle(), prompts, GenerationConfig(max_new_tokens=n, method="ddtree", budget=32))
    assert chain.tokens == expected and tree.tokens == expected
    assert chain.stats.target_forwards == n
    assert tree.stats.accept_histogram == {5: 4 * len(prompts)}
    assert tree.stats.target_forwards == 1 + (n - 1) // 5


def test_mixed_oracle_ragged_acceptance():
    """Rank 0 at some positions and rank 1 at others: different requests accept different lengths in
    the same round; the output is still the target's greedy output and the forwards drop."""
    target = tiny_target(6)
    prompts = random_prompts(13, [4, 10, 7], target.config.vocab_size)
    n = 30
    ranks = (0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 1, 0, 0)
    drafter = OracleDrafter(target, prompts, n, rank=lambda pos: ranks[pos % 13], top=3, margin=0.5)
    out = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=n, method="ddtree", budget=16))
    assert out.tokens == greedy_generate(target, prompts, n)
    assert len(set(out.stats.accept_lengths)) > 1
    assert out.stats.target_forwards < n // 2
