"""engine.budget: the draft path probabilities and bucket sums, the estimator (exact for a drafter whose
distribution is the target's, checked against the engine's own sampled acceptance), its calibration,
the cost table and the choice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kdtree_engine.engine import SamplingParams, accept_tokens
from kdtree_engine.engine.budget import AUTO_BUCKETS, FEW_ROWS, BudgetPolicy, choose, steady_rate, total_of
from kdtree_engine.engine.budget_estimates import (
    COST_WINDOW,
    MIN_COST_ROUNDS,
    PRIOR_PAIRS,
    SLOPE_PAIRS,
    Calibration,
    CostTable,
)
from kdtree_engine.ref.round_report import bucket_sums, path_probabilities
from kdtree_engine.tree import DraftTree, build_tree_from_logits, compile_tree, logits_topk


def _tree(logits: torch.Tensor, budget: int):
    tree = build_tree_from_logits(logits, budget, impl="ref")
    b = logits.shape[0]
    vin = compile_tree(tree, torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), impl="ref")
    return tree, vin


def _topk(logits: torch.Tensor, budget: int):
    """The top-k the tree of `budget` nodes is built from (k >= 1: a tree of 0 nodes has no nodes)."""
    return logits_topk(logits, max(budget, 1), impl="ref")


def _brute_force(logits: torch.Tensor, tree) -> torch.Tensor:
    """Each node's path probability, walking its parents on the host."""
    probs = torch.softmax(logits.double(), dim=-1)
    b, n = tree.tokens.shape
    out = torch.zeros(b, n, dtype=torch.float64)
    for r in range(b):
        for i in range(n):
            node, p = i + 1, 1.0
            if int(tree.tokens[r, i]) < 0:
                continue
            while node > 0:
                p *= float(probs[r, int(tree.depths[r, node - 1]) - 1, int(tree.tokens[r, node - 1])])
                node = int(tree.parents[r, node])
            out[r, i] = p
    return out


@pytest.mark.parametrize("budget", [0, 1, 7, 30])
def test_path_probabilities_are_the_products_along_the_ancestors(budget):
    gen = torch.Generator().manual_seed(budget)
    logits = torch.randn(3, 4, 9, generator=gen) * 2
    logits[1] = logits[1].round()  # ties
    logits[2, :, 5:] = float("-inf")  # masked tokens: fewer nodes than the budget
    tree, vin = _tree(logits, budget)
    got = path_probabilities(*_topk(logits, budget), tree.tokens, tree.depths, vin.visibility)
    torch.testing.assert_close(got.double(), _brute_force(logits, tree), rtol=1e-5, atol=1e-7)
    assert bool((got[:, 1:] <= got[:, :-1] + 1e-6).all())  # best-first: non-increasing


def test_bucket_sums_take_the_first_nodes_and_stop_at_the_tree():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.0], [0.9, 0.05, 0.0, 0.0]])
    got = bucket_sums(probs, (0, 1, 2, 4, 64))
    want = torch.tensor([[0.0, 0.5, 0.75, 0.875, 0.875], [0.0, 0.9, 0.95, 0.95, 0.95]])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("budget", [0, 4, 8, 16])
def test_estimator_is_exact_when_the_drafter_is_the_target(budget):
    """A target whose next-token distribution depends on the depth only, drafted by itself: the mean
    accepted length of the engine's sampled acceptance (4096 requests) is 1 + the sum of the tree's
    path probabilities, within four standard errors."""
    depth, vocab, b = 6, 5, 4096
    gen = torch.Generator().manual_seed(11)
    per_depth = torch.randn(depth, vocab, generator=gen) * 1.5  # [L, V]
    one, vin = _tree(per_depth[None], budget)  # every request drafts the same: one tree, repeated
    tree = DraftTree(*(t.expand(b, -1).contiguous() for t in (one.tokens, one.depths, one.parents)),
                     one.num_nodes.expand(b).contiguous(), one.max_depth)  # fmt: skip
    probs = path_probabilities(*_topk(per_depth[None], budget), one.tokens, one.depths, vin.visibility)
    predicted = 1 + bucket_sums(probs, [budget])
    # the target's logits at node i: its distribution at depth(i) + 1 (the root: depth 1)
    node_depth = torch.cat([torch.zeros(b, 1, dtype=torch.int64), tree.depths.clamp(min=0)], dim=1)
    target = per_depth[node_depth.clamp(max=depth - 1)]  # [B, N, V]
    acc = accept_tokens(tree, target, SamplingParams(temperature=1.0), seed=3, offset=0, impl="ref")
    observed = acc.accept_len.double()
    sigma = observed.std().item() / math.sqrt(b)
    assert abs(observed.mean().item() - predicted[0, 0].item()) <= 4 * sigma + 1e-9


def test_calibration_is_accepted_over_predicted_per_bucket_and_borrows_the_nearest():
    cal = Calibration(AUTO_BUCKETS)  # (0, 4, 8, 16, 32, 64): bucket 8 is index 2
    assert cal.ratio(3) == 1.0  # nothing observed: a calibrated drafter
    cal.observe(2, accepted=np.array([2, 1]), predicted=np.array([3.0, 3.0]))
    cal.observe(2, accepted=np.array([3]), predicted=np.array([2.0]))
    assert cal.ratio(2) == pytest.approx(6 / 8)
    assert cal.ratio(1) == cal.ratio(4) == pytest.approx(6 / 8)  # the nearest tried bucket
    cal.observe(4, accepted=np.array([4]), predicted=np.array([8.0]))
    assert cal.ratio(3) == pytest.approx(6 / 8) and cal.ratio(5) == pytest.approx(0.5)


def _measured(costs: CostTable, bucket: int, seconds: float) -> None:
    for _ in range(MIN_COST_ROUNDS):
        costs.observe(bucket, seconds)


def test_costs_are_medians_and_unmeasured_buckets_get_tried():
    assert MIN_COST_ROUNDS == 3
    costs = CostTable(AUTO_BUCKETS)
    assert costs.estimate(8) == 0.0  # not measured: try it
    for t in (3.0, 1.0):
        costs.observe(16, t)
    assert costs.measured(16) == 2.0 and costs.estimate(16) == 0.0  # two rounds: tried again
    costs.observe(16, 2.0)
    assert costs.measured(16) == 2.0 and costs.estimate(16) == 2.0
    assert costs.estimate(0) == costs.estimate(32) == 0.0
    for t in range(40):  # the last COST_WINDOW rounds only
        costs.observe(16, 10.0 + t)
    assert costs.measured(16) == 10.0 + 40 - COST_WINDOW / 2 - 0.5


def test_stage_timed_calls_price_their_rounds_apart():
    """A call that times its stages (slower rounds) prices them in cost tables of its own. An untimed
    call after it prices a bucket it has not measured at the stage-timed price, shifted by the median
    difference over the buckets both have measured (none yet: unshifted), but a tree no dearer than the
    largest tree it has measured, and its own measurements replace it; a later stage-timed call finds
    its own prices again."""
    policy = BudgetPolicy(AUTO_BUCKETS, depth=48)
    policy.new_call(stage_timed=True)
    for k, t in ((0, 2.5), (16, 3.0), (32, 4.0)):
        for _ in range(MIN_COST_ROUNDS):
            policy.observe(k, t, [0], [1], None)
    policy.new_call(stage_timed=False)
    assert policy.costs.measured(16) is None
    assert [policy.costs.estimate(k) for k in (0, 8, 16, 32)] == [2.5, 0.0, 3.0, 4.0]
    for k, t in ((0, 0.5), (16, 1.5)):
        for _ in range(MIN_COST_ROUNDS):
            policy.observe(k, t, [0], [1], None)
    # shifts -2.0 (the step) and -1.5 (bucket 16): median -1.75, the step's price; bucket 8 still
    # untried; bucket 32 (4.0 - 1.75 shifted) no dearer than bucket 16, the largest tree measured here
    assert [policy.costs.estimate(k) for k in (0, 8, 16, 32)] == [0.5, 0.0, 1.5, 1.5]
    policy.new_call(stage_timed=True)
    assert [policy.costs.estimate(k) for k in (0, 16, 32)] == [2.5, 3.0, 4.0]
    policy.new_call()
    assert policy.costs.estimate(16) == 1.5


def test_an_unmeasured_tree_is_never_priced_above_what_the_measured_trees_imply():
    """A tree bucket not measured in this timing mode is priced from the trees that are, not at the
    other mode's price: stage-timed rounds are noisy, and a bucket priced dear there was never picked,
    so never measured here (bucket 32 at 1.4 against 64 at 0.93 stage-timed). Untimed, 16 costs 0.56
    and 64 0.70: 32 sits on the line between them, and with only 16 measured, 32 and 64 cost what 16
    does until measured; below the smallest measured tree the other mode's shifted price holds, kept
    under that tree's."""
    policy = BudgetPolicy(AUTO_BUCKETS, depth=48)
    policy.new_call(stage_timed=True)
    for k, t in ((0, 0.5), (8, 1.0), (16, 1.14), (32, 1.4), (64, 0.93)):
        for _ in range(MIN_COST_ROUNDS):
            policy.observe(k, t, [0], [1], None)
    policy.new_call(stage_timed=False)
    for _ in range(MIN_COST_ROUNDS):
        policy.observe(16, 0.56, [0], [1], None)
    assert [policy.costs.estimate(k) for k in (32, 64)] == [0.56, 0.56]
    for _ in range(MIN_COST_ROUNDS):
        policy.observe(64, 0.70, [0], [1], None)
    assert policy.costs.estimate(32) == pytest.approx(0.56 + 0.14 * 16 / 48)
    # bucket 8, below the smallest measured tree: the stage-timed 1.0 shifted by the median difference
    # (-0.405) is 0.595, kept under bucket 16's 0.56
    shift = float(np.median([0.56 - 1.14, 0.70 - 0.93]))
    assert policy.costs.estimate(8) == pytest.approx(min(1.0 + shift, 0.56))
    assert policy.costs.estimate(0) == pytest.approx(0.5 + shift)  # the step: no line through trees
    for _ in range(MIN_COST_ROUNDS):
        policy.observe(32, 0.66, [0], [1], None)
    assert policy.costs.estimate(32) == 0.66  # its own median, once measured


def test_choice_maximizes_tokens_per_second():
    buckets = (0, 8, 32)
    cal = Calibration(buckets)
    sums = [[0.0, 2.0, 3.0], [0.0, 1.0, 1.2]]  # two requests' S at each bucket
    expected = cal.expected(np.array(sums)).sum(axis=0).tolist()  # E summed over the requests
    assert expected == [2.0, 5.0, 6.2]
    # a round like every other (E at the levels): the steady rate's own bucket, the ratio's choice
    for costs, best in (([1.0, 2.0, 3.0], 1), ([1.0, 3.0, 4.0], 0)):  # 2.5 per unit; speculation off
        assert choose(expected, costs, steady_rate(expected, costs)) == best
    assert choose(expected, [1.0, 2.0, 0.0], 9.0) == 2  # never measured: tried first
    assert choose([2.0, 4.0], [1.0, 2.0], 2.0) == 0  # a tie: the smaller bucket


def test_choice_leaves_the_steady_bucket_only_when_its_extra_tokens_pay_for_their_time():
    # steady: bucket 32 at 3.0 tokens in 1.0 s (rate 3.0) against 2.75 and a step's 2.0
    costs = [0.5, 0.8, 1.0]
    rate = steady_rate([1.0, 2.2, 3.0], costs)
    assert rate == 3.0
    ratio = lambda e: max(range(3), key=lambda j: e[j] / costs[j])  # noqa: E731
    # a round of little promise: bucket 8's 0.85 tokens beyond a step cost 0.3 s, worth 0.9 at the
    # steady rate: a step, where the ratio drafts (2.31 tokens per second against 2.0)
    low = [1.0, 1.85, 2.3]
    assert ratio(low) == 1 and choose(low, costs, rate) == 0
    # a round of high promise: bucket 32's 0.8 tokens beyond bucket 8 cost 0.2 s, worth 0.6: bucket
    # 32, where the ratio takes bucket 8 (5.0 against 4.8)
    high = [1.0, 4.0, 4.8]
    assert ratio(high) == 1 and choose(high, costs, rate) == 2
    assert choose([1.0, 4.5, 4.8], costs, rate) == 1  # 0.3 tokens for 0.2 s: not worth it


def _slope(xs, ys) -> float:
    cal = Calibration((0, 8))
    cal.observe_choices(1, np.array(xs, dtype=float), np.array(ys, dtype=float))
    return float(cal.slopes()[1])


def test_fit_slope_is_least_squares_shrunk_and_never_negative():
    assert _slope([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx(2 * 3 / (3 + SLOPE_PAIRS))
    assert _slope([1.0, 1.0], [3.0, 3.0]) == 0.0  # no spread in x: no slope
    assert _slope([1.0, 2.0], [4.0, 3.0]) == 0.0  # a falling fit: none
    assert Calibration((0, 8)).slopes().tolist() == [0.0, 0.0]  # no pairs


def test_expected_mean_is_shrunk_towards_the_calibrated_level():
    """A bucket's mean acceptance is its pairs' mean pulled towards r * level by PRIOR_PAIRS
    pseudo-pairs: one unlucky round does not rule a bucket out."""
    cal = Calibration((0, 8))
    cal.observe_drafts(np.array([[0.0, 4.0]] * 3))  # level of S at bucket 8: 4
    cal.observe(1, accepted=np.array([3, 3, 3]), predicted=np.array([2.0, 2.0, 2.0]))  # r = 1.5: prior 6
    assert cal.expected(np.array([[0.0, 1.0]]))[0, 1] == pytest.approx(1 + 1.5 * 1.0)  # no pairs: 1 + r x
    cal.observe_choices(1, np.array([4.0]), np.array([0.0]))  # one round that accepted nothing
    got = cal.expected(np.array([[123.0, 4.0]]))[0]
    assert got[1] == pytest.approx(1 + (0 + PRIOR_PAIRS * 6.0) / (1 + PRIOR_PAIRS))
    assert got[0] == 1.0  # an autoregressive step commits one token


def test_a_bad_draft_does_not_keep_speculation_off():
    """One request whose last draft was poor: the policy steps autoregressively, and as that S grows
    stale it returns to the bucket's level and the policy drafts again, long before L + 1 rounds."""
    policy = BudgetPolicy((0, 16), depth=16)
    _measured(policy.costs, 0, 1.0)
    _measured(policy.costs, 16, 3.5)
    cal = policy.calibration
    xs = np.array([2.0, 6.0] * 8)  # acceptance follows the S seen: slope 1 (0.5 once shrunk), level 4
    cal.observe_choices(1, xs, xs)
    cal.observe_drafts(np.stack([np.zeros(16), xs], axis=1))
    cal.observe(1, np.array([4]), np.array([4.0]))
    policy.observe(16, None, [0], [5], np.array([[0.0, 4.0]]))  # a round read: S = 4
    assert policy.pick([True], must_draft=False) == 16  # 5 tokens for 3.5 against 1 for 1
    policy.observe(16, None, [0], [1], np.array([[0.0, 0.05]]))  # a poor draft read
    # S pulled back towards the level by half a round at a time: E(16) 3.7, 4.2, 4.4 against 4.65 at
    # the level; the first two rounds' tokens beyond a step do not pay for its time at the steady rate
    picks = [policy.pick([True], must_draft=False) for _ in range(5)]
    assert picks == [0, 0, 0, 16, 16]


def test_choices_learn_from_what_they_saw():
    """The fit pairs the S each choice saw (an earlier round's, rounds are pipelined) with the
    acceptance of the round it chose, in pick order."""
    policy = BudgetPolicy((0, 8), depth=8)
    _measured(policy.costs, 0, 1.0)
    _measured(policy.costs, 8, 1.0)
    policy.pick([True, True], must_draft=True)  # nothing read yet: sees zeros
    policy.observe(8, None, [0, 1], [2, 2], np.array([[0.0, 3.0], [0.0, 1.0]]))
    policy.pick([True, True], must_draft=True)  # sees 3 and 1 (age 0: read since)
    policy.pick([True, True], must_draft=True)  # the same, aged one round: 2.5 and 1.5 (level 2)
    policy.observe(8, None, [0, 1], [4, 1], np.array([[0.0, 2.0], [0.0, 3.0]]))
    policy.observe(8, None, [0, 1], [3, 2], np.array([[0.0, 2.0], [0.0, 3.0]]))
    cal = policy.calibration
    assert cal.n[1] == 6 and cal.sx[1] == 0 + 0 + 3 + 1 + 2.5 + 1.5
    assert cal.sxy[1] == 3 * 3 + 1 * 0 + 2.5 * 2 + 1.5 * 1
    assert not policy.pending


def test_buckets_a_round_did_not_build_are_seen_at_their_level():
    """A round of bucket 8 knows S up to 8 only (NaN beyond): bucket 32's level comes from the rounds
    that built it, and a request whose last draft stopped at 8 is seen at that level there."""
    policy = BudgetPolicy((0, 8, 32), depth=8)
    policy.pick([True], must_draft=True)
    policy.observe(32, None, [0], [3], np.array([[0.0, 1.0, 3.0]]))
    policy.pick([True], must_draft=True)
    policy.observe(8, None, [0], [2], np.array([[0.0, 2.0, np.nan]]))
    levels = policy.calibration.levels()
    assert levels[1] == 1.5 and levels[2] == 3.0
    assert policy._seen(np.array([0])).tolist() == [[0.0, 2.0, 3.0]]


def test_total_of_is_numpys_sum_to_the_bit():
    """budget.total_of (Python floats up to FEW_ROWS values) gives float(values.sum()) exactly: on
    contiguous and strided columns, with NaN, infinities, signed zeros, ties and magnitudes far apart."""
    assert FEW_ROWS <= 7  # numpy adds fewer than 8 values one after another
    rng = np.random.default_rng(0)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 1.0]
    for size in range(FEW_ROWS + 3):
        for trial in range(400):
            values = rng.random((size, 5)) * 10.0 ** rng.integers(-9, 10, (size, 5))
            if trial % 4 == 0:
                values[rng.random((size, 5)) < 0.3] = rng.choice(special)
            if trial % 4 == 1:
                values[:] = rng.choice([-0.0, 0.0, 1.5])
            for column in (values[:, 2], np.ascontiguousarray(values[:, 2]), 1.0 + values[:, 3]):
                want, got = float(column.sum()), total_of(column)
                assert got == want or (math.isnan(got) and math.isnan(want))
                assert math.copysign(1.0, got) == math.copysign(1.0, want)


def test_rows_by_columns_is_the_two_step_indexing_laid_out_alike():
    """BudgetPolicy._rows_by_columns: values[rows][:, columns] in one indexing, with the same values
    and the same memory layout (the calibration's sums over it add in layout order)."""
    rng = np.random.default_rng(0)
    for rows_count in range(6):
        for columns_count in range(4):
            values = rng.random((8, 7))
            values[rng.random((8, 7)) < 0.2] = np.nan
            rows = rng.permutation(8)[:rows_count]
            columns = np.sort(rng.permutation(7)[:columns_count])
            want = values[rows][:, columns]
            got = BudgetPolicy._rows_by_columns(values, rows, columns[:, None])
            np.testing.assert_array_equal(got, want)
            assert got.strides == want.strides or got.size <= 1
