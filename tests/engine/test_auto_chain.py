"""The DFlash chain among the auto budget's buckets: bucket L (the drafter's L drafted positions, each
node the top-1 of its position) next to the best-first trees, its S told by every drafting round, its
estimator exact for a drafter whose distribution is the target's, and the engine picking it where it
beats every tree while greedy output stays autoregressive decoding's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kdtree_engine.engine import GenerationConfig, Runner, SamplingParams, accept_tokens, generate
from kdtree_engine.engine.budget import AUTO_BUCKETS, BudgetPolicy, auto_buckets
from kdtree_engine.engine.budget_estimates import CostTable
from kdtree_engine.engine.stages import chain_of
from kdtree_engine.model import greedy_generate
from kdtree_engine.ref.round_report import bucket_sums, chain_sums, path_probabilities, round_sums
from kdtree_engine.tree import build_tree_from_logits, compile_tree, logits_topk
from tests.engine.helpers import OracleDrafter, pick_sequence, random_prompts, tiny_target


def test_the_chain_is_a_bucket_unless_a_tree_has_its_size_or_it_exceeds_the_largest():
    assert auto_buckets(15) == (0, 4, 8, 15, 16, 32, 64)
    assert auto_buckets(7) == (0, 4, 7, 8, 16, 32, 64)
    assert auto_buckets(16) == auto_buckets(4) == auto_buckets(None) == AUTO_BUCKETS
    assert auto_buckets(65) == auto_buckets(0) == AUTO_BUCKETS


def _compiled(tree, b):
    zeros = torch.zeros(b, dtype=torch.int64)
    return compile_tree(tree, zeros, zeros, impl="ref")


def _brute_chain_sum(logits: torch.Tensor) -> torch.Tensor:
    """sum over depths d of prod_{i <= d} max softmax of position i, in float64: [B, L, V] -> [B]."""
    top = logits.double().softmax(-1).max(-1).values  # [B, L]
    return top.cumprod(dim=1).sum(dim=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_round_sums_of_a_tree_round_and_of_the_chains_round(seed):
    """A tree round of n nodes tells the first-k sums at the trees up to n, NaN beyond, and the chain's
    S from the top-1 of each position; the chain's round tells its own S only. Ties and masked tokens
    included."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 11, generator=gen) * 2
    logits[1] = logits[1].round()  # ties
    logits[2, :, 4:] = float("-inf")  # few tokens left
    buckets, chain = auto_buckets(7), 7
    want_chain = _brute_chain_sum(logits)
    for n in (4, 8, 16):
        tree = build_tree_from_logits(logits, n, impl="ref")
        topk = logits_topk(logits, n, impl="ref")
        probs = path_probabilities(*topk, tree.tokens, tree.depths, _compiled(tree, 3).visibility)
        got = round_sums(probs, topk[0], buckets, n, chain)
        trees = [k for k in buckets if k != chain]
        for j, k in enumerate(buckets):
            if k == chain:
                torch.testing.assert_close(got[:, j].double(), want_chain, rtol=1e-5, atol=1e-7)
            elif k <= n:
                torch.testing.assert_close(got[:, j], bucket_sums(probs, trees)[:, trees.index(k)])
            else:
                assert bool(got[:, j].isnan().all())
    topk = logits_topk(logits, 1, impl="ref")
    tree = chain_of(topk[1][..., 0])
    probs = path_probabilities(*topk, tree.tokens, tree.depths, _compiled(tree, 3).visibility)
    got = round_sums(probs, topk[0], buckets, chain, chain)
    j = buckets.index(chain)
    torch.testing.assert_close(got[:, j].double(), want_chain, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chain_sums(topk[0]).double(), want_chain, rtol=1e-5, atol=1e-7)
    assert bool(got[:, [i for i in range(len(buckets)) if i != j]].isnan().all())


def test_the_chains_estimator_is_exact_when_the_drafter_is_the_target():
    """A target whose next-token distribution depends on the depth only, drafted by itself as a chain:
    the mean accepted length of the engine's sampled acceptance (4096 requests) is 1 + the chain's S,
    within four standard errors."""
    depth, vocab, b = 6, 5, 4096
    gen = torch.Generator().manual_seed(11)
    per_depth = torch.randn(depth, vocab, generator=gen) * 1.5  # [L, V]
    top_lp, top_ids = logits_topk(per_depth[None].expand(b, -1, -1), 1, impl="ref")
    tree = chain_of(top_ids[..., 0])
    predicted = 1 + chain_sums(top_lp)[0].item()
    node_depth = torch.cat([torch.zeros(b, 1, dtype=torch.int64), tree.depths], dim=1)
    target = per_depth[node_depth.clamp(max=depth - 1)]  # the root's: depth 1's distribution
    acc = accept_tokens(tree, target, SamplingParams(temperature=1.0), seed=3, offset=0, impl="ref")
    observed = acc.accept_len.double()
    sigma = observed.std().item() / math.sqrt(b)
    assert abs(observed.mean().item() - predicted) <= 4 * sigma + 1e-9


def test_the_chains_rounds_stay_greedy_and_its_S_comes_from_every_draft(monkeypatch):
    """Rounds of the chain between trees and steps commit plain greedy decoding's tokens, and the
    chain's level of S is known after tree rounds alone (every draft tells it)."""
    target = tiny_target(4)
    prompts = random_prompts(5, [7, 4], target.config.vocab_size)
    drafter = OracleDrafter(target, prompts, 60, block_size=8, rank=lambda pos: pos % 3 // 2, top=2)
    monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([4, 16]))
    out = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=30, budget="auto"))
    assert set(out.stats.budgets) == {4, 16}
    monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([7, 0, 4, 7, 7, 64, 0, 0, 7]))
    out = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=40, budget="auto"))
    assert {0, 4, 7, 64} == set(out.stats.budgets) and out.stats.budget_report[7]["observed"] > 1
    assert out.tokens == greedy_generate(target, prompts, 40)


def test_auto_picks_the_chain_where_it_beats_every_tree(monkeypatch):
    """A drafter whose top-1 is always the target's token but whose probabilities are flat between two
    candidates (trees go wide, the chain is always accepted whole): with costs that grow with the nodes
    verified (a fixed table, measured as the engine measures), auto, once every bucket is tried (a
    Runner's first two calls), spends most rounds on the chain, and greedy output stays autoregressive
    decoding's."""
    real_observe = CostTable.observe  # each bucket still tried before its cost counts (exploration)
    monkeypatch.setattr(CostTable, "observe", lambda self, k, s: real_observe(self, k, 1e-3 * (1.0 + k / 64)))
    target = tiny_target(4)
    prompts = random_prompts(6, [5, 8], target.config.vocab_size)
    drafter = OracleDrafter(target, prompts, 90, block_size=8, top=2, margin=0.05)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=80, budget="auto"), batch_size=2,
                    prompt_len=8)  # fmt: skip
    first = runner.generate(prompts)  # every bucket tried in these two calls
    runner.generate(prompts)
    third = runner.generate(prompts)
    assert first.tokens == third.tokens == greedy_generate(target, prompts, 80)
    budgets = third.stats.budgets
    assert budgets.count(7) > len(budgets) / 2, third.stats.budget_histogram


def _policy_with_chain(chain_rounds: int, chain_s: float = 3.0) -> BudgetPolicy:
    """Buckets (0, 4, 8, 15, 16, 32, 64), the chain (15) costing what bucket 16 costs. 40 rounds of bucket
    16 (each also telling buckets 4 and 8) accept 6 drafted tokens per request, then `chain_rounds`
    rounds of the chain accept 6.5, a round in turn 1.5 more and less (its noise): the chain is better
    by 0.5 token a round. Its S is chain_s: at 3 its rounds accept 2.2 times what S predicts (a drafter
    that understates its top-1), at 5 1.3 times."""
    from tests.engine.test_budget_call import _measured

    buckets = auto_buckets(15)
    policy = BudgetPolicy(buckets, depth=64)
    _measured(policy, {0: 1.0, 4: 1.5, 8: 1.6, 15: 1.8, 16: 1.8, 32: 2.2, 64: 3.0})
    rows, nan = [0, 1], np.nan
    tree_sums = np.array([[0.0, 2.0, 3.5, chain_s, 5.0, nan, nan]] * 2)  # S at 0, 4, 8, the chain, 16
    for _ in range(40):
        policy.pick([True, True], must_draft=True)
        would = np.array([[nan, 3.0, 5.0, nan, 7.0, nan, nan]] * 2)
        policy.observe(16, None, rows, [7, 7], tree_sums, would)
    chain_sums = np.array([[nan, nan, nan, chain_s, nan, nan, nan]] * 2)
    for r in range(chain_rounds):
        policy.pick([True, True], must_draft=True)
        got = 7.5 + (1.5 if r % 2 else -1.5)
        policy.observe(
            15, None, rows, [got, got], chain_sums, np.array([[nan, nan, nan, got, nan, nan, nan]] * 2)
        )
    policy.pending.clear()
    return policy


def test_the_chain_takes_rounds_from_the_trees_once_its_own_rounds_show_it_better():
    """The chain's E counts at its lower bound in the per-round choice (budget module docstring): after
    2 rounds of its own, better than bucket 16 on average but known from 4 pairs, the choice keeps bucket
    16 (at the chain's estimate alone it took the chain); after 60 rounds, it takes the chain."""
    few = _policy_with_chain(2)
    assert few.pick([True, True], must_draft=True) == 16
    few.pending.clear()
    bonus = few.calibration.bonus
    few.calibration.bonus = lambda: 0.0 * bonus()  # the estimate alone
    assert few.pick([True, True], must_draft=True) == 15
    many = _policy_with_chain(60)
    assert many.pick([True, True], must_draft=True) == 15


def test_a_chain_whose_rounds_accept_what_its_s_predicts_is_no_candidate():
    """The chain's own rounds accept 1.3 times what its S predicts (below CHAIN_MIN_RATIO): the best-first
    tree of the next bucket holds the likelier paths at the same cost, so the choice does not take the
    chain however its estimate reads (budget module docstring); before any round of its own it is a
    candidate, so that it gets tried."""
    calibrated = _policy_with_chain(60, chain_s=5.0)
    assert calibrated.calibration.own_ratio(3) == pytest.approx(6.5 / 5.0)
    assert calibrated.pick([True, True], must_draft=True) == 16
    untried = _policy_with_chain(0, chain_s=5.0)
    assert untried.calibration.own_ratio(3) is None
    assert untried._candidate_mask().all()


def test_the_steady_rate_weighs_the_chain_at_its_lower_bound_as_the_choice_does():
    """An untested chain's promise must not set the rate every round pays for its time: the choice sees
    the chain at its lower bound, and so does the steady rate (lambda) and the steady choice that
    decides whether a step explores. Before, the rate took the chain's estimate alone: each round's
    best value was then a step (the tree's expected tokens fell short of the chain's rate times its
    cost) while the chain itself was never picked, and calls stepped for tens of rounds where the
    trees paid (budget module docstring)."""
    few = _policy_with_chain(2)  # the chain's estimate above bucket 16's, known from 4 pairs only
    ybar, _ = few.calibration.long_run()
    _, costs, _ = few.costs.estimates()
    chain, tree = few.buckets.index(15), few.buckets.index(16)
    assert ybar[chain] > ybar[tree] and ybar[chain] - few.calibration.bonus()[chain] < ybar[tree]
    assert few._steady_rate(2) == pytest.approx(2 * (1 + ybar[tree]) / costs[tree])
    assert few._steady_choice(few._long_run_as_chosen(), costs) == tree
    many = _policy_with_chain(60)  # known from 120 pairs: its lower bound above bucket 16's estimate
    ybar, _ = many.calibration.long_run()
    assert many._steady_rate(2) > 2 * (1 + ybar[tree]) / costs[tree]
