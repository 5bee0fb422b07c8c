"""The counts each smaller tree would have committed on a round (ref.round_report.would_commit) and the
policy's use of them: every tree bucket judged on the same rounds as the larger ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kdtree_engine.engine.budget import BudgetPolicy, auto_buckets
from kdtree_engine.engine.sampling import SamplingParams, accept_tokens
from kdtree_engine.ref.round_report import would_commit
from kdtree_engine.tree import build_tree_from_logits

BUCKETS = auto_buckets(15)  # 0 4 8 15 16 32 64: the chain is bucket 15


def _deep_round(n: int, seed: int):
    """A tree of n nodes over random draft logits and target logits that favour one child of every
    node (so that accepted paths run deep), for 8 requests."""
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randn(8, 8, 6, generator=gen) * 2.0
    tree = build_tree_from_logits(draft, n, impl="ref")
    logits = torch.randn(8, n + 1, 6, generator=gen)
    for b in range(8):
        for i in range(n + 1):
            kids = (tree.parents[b, 1:] == i).nonzero().flatten()
            if kids.numel():
                logits[b, i, tree.tokens[b, kids[0]]] += 4.0
    return draft, tree, logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("n", [16, 64])
def test_a_round_tells_what_each_smaller_tree_commits(temperature, n):
    """would_commit of a round of bucket n equals the count of accepting the tree of each bucket k < n
    on its own (the same target tokens drawn at each node), greedy and sampled; NaN at bucket 0, the
    chain's and the larger buckets."""
    draft, tree, logits = _deep_round(n, seed=n)
    params = SamplingParams(temperature=temperature)
    whole = accept_tokens(tree, logits, params, seed=7, offset=0, impl="ref")
    would = would_commit(whole.accepted, BUCKETS, n, chain=15)
    assert would[:, BUCKETS.index(n)].tolist() == whole.accept_len.float().tolist()
    assert whole.accept_len.max() >= 4  # deep paths: something to cut
    for j, k in enumerate(BUCKETS):
        if k in (0, 15) or k > n:
            assert torch.isnan(would[:, j]).all()
            continue
        small = build_tree_from_logits(draft, k, impl="ref")
        got = accept_tokens(small, logits[:, : k + 1], params, seed=7, offset=0, impl="ref")
        assert would[:, j].tolist() == got.accept_len.float().tolist()


def test_a_chain_round_tells_its_own_count_only():
    accepted = torch.tensor([[0, 1, 2, 3, -1], [0, -1, -1, -1, -1]])
    would = would_commit(accepted, BUCKETS, 15, chain=15)
    assert would[:, BUCKETS.index(15)].tolist() == [4.0, 1.0]
    others = [j for j, k in enumerate(BUCKETS) if k != 15]
    assert torch.isnan(would[:, others]).all()


def test_the_policy_fits_the_smaller_trees_on_the_rounds_of_a_larger_one():
    """A round of bucket 32 read with would_commit adds a pair to buckets 4, 8 and 16 (the counts they
    would have committed, against their own S of the draft), none to the chain or bucket 64; read
    without it, only to bucket 32."""
    fitted = []
    for told in (True, False):
        policy = BudgetPolicy(BUCKETS, depth=64)
        policy.pick([True, True], must_draft=True)
        sums = np.array([[0.0, 1.0, 1.5, 2.5, 2.0, 2.6, math.nan]] * 2)
        would = np.array([[math.nan, 2.0, 3.0, math.nan, 4.0, 5.0, math.nan]] * 2)
        policy.observe(32, 1e-3, [0, 1], [5, 5], sums, would if told else None)
        fitted.append(dict(zip(BUCKETS, policy.calibration.n.tolist(), strict=True)))
        if told:
            ratio = policy.calibration.ratio(BUCKETS.index(16))
            assert ratio == pytest.approx(3.0 / 2.0)  # (4 - 1) accepted over S 2.0
    assert fitted[0] == {0: 0, 4: 2, 8: 2, 15: 0, 16: 2, 32: 2, 64: 0}
    assert fitted[1] == {0: 0, 4: 0, 8: 0, 15: 0, 16: 0, 32: 2, 64: 0}


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_engine_hands_the_policy_each_rounds_counts_at_the_smaller_trees(monkeypatch, pipelined):
    """In a real auto run every speculative round read hands the policy, per running request, its own
    count at the bucket it ran, a count at each smaller tree bucket (never more than its own, never
    less than 1) and NaN at the chain (unless it ran) and at the larger buckets; the sums beside them."""
    from kdtree_engine.engine import GenerationConfig, Runner, loop
    from tests.engine.helpers import pick_sequence, random_prompts, tiny_drafter, tiny_target

    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([64, 32, 7, 16, 8, 4, 0]))
    seen = []
    real_observe = BudgetPolicy.observe

    def observe(self, bucket, seconds, rows, counts, sums, would=None):
        seen.append((bucket, np.asarray(rows), np.asarray(counts), sums, would))
        return real_observe(self, bucket, seconds, rows, counts, sums, would)

    monkeypatch.setattr(BudgetPolicy, "observe", observe)
    target, drafter = tiny_target(3), tiny_drafter(3, block_size=8)  # the chain is bucket 7
    buckets = auto_buckets(7)
    prompts = random_prompts(4, [6, 11, 3], target.config.vocab_size)
    Runner(target, drafter, GenerationConfig(max_new_tokens=40, budget="auto"), batch_size=3,
           prompt_len=11).generate(prompts)  # fmt: skip
    speculative = [s for s in seen if s[0] > 0]
    assert {s[0] for s in speculative} == {64, 32, 7, 16, 8, 4}
    for bucket, rows, counts, sums, would in speculative:
        j = buckets.index(bucket)
        told = would[rows]
        assert told[:, j].tolist() == counts[rows].astype(float).tolist()
        for i, k in enumerate(buckets):
            if k == 0 or k > bucket or (7 in (k, bucket) and k != bucket):
                assert np.isnan(told[:, i]).all()
            else:
                assert ((told[:, i] >= 1) & (told[:, i] <= told[:, j])).all()
                assert not np.isnan(sums[rows][:, i]).any()


def test_observe_nested_is_observe_choices_and_observe_per_column_against_the_fit_before():
    from kdtree_engine.engine.budget_estimates import Calibration

    rng = np.random.default_rng(2)
    seen, accepted, own = (rng.uniform(0.0, 5.0, (6, 3)) for _ in range(3))
    columns = np.array([1, 2, 4])
    once, each = Calibration(BUCKETS), Calibration(BUCKETS)
    before = rng.uniform(0.0, 5.0, (2, 6))
    for cal in (once, each):  # an earlier round of bucket 16, so the fit is not the prior's alone
        cal.observe_choices(4, before[0], before[1])
        cal.observe(4, np.full(6, 2.0), np.full(6, 3.0))
    a, b = each.expected_coefficients()
    once.observe_nested(columns, seen, accepted, own, once.expected_coefficients())
    for c, j in enumerate(columns):
        expected = np.maximum(1.0, a[j] + b[j] * seen[:, c])
        each.observe_choices(j, seen[:, c], accepted[:, c], expected)
        each.observe(j, accepted[:, c], own[:, c])
    for name in ("n", "sx", "sy", "sxx", "sxy", "misses", "accepted", "predicted"):
        assert getattr(once, name) == pytest.approx(getattr(each, name)), name
