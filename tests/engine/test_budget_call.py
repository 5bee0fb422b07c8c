"""engine.budget_call: the static call's test of the auto budget (autoregressive steps whenever they
would end the call soonest), its pieces against known values, and the policy using it."""

from __future__ import annotations

import numpy as np
import pytest

from kdtree_engine.engine import budget
from kdtree_engine.engine.budget import AUTO_BUCKETS, PICK_REASONS, PROBE_STEPS, SETTLED_STEPS, BudgetPolicy
from kdtree_engine.engine.budget_call import (
    KEEP_ROUNDS,
    CallTest,
    Paces,
    expected_last,
    expected_max_normal,
    steady_call_seconds,
)
from kdtree_engine.engine.budget_estimates import MIN_COST_ROUNDS


@pytest.mark.parametrize(
    ("count", "value"), [(1, 0.0), (2, 1 / np.sqrt(np.pi)), (10, 1.53875), (100, 2.50759)]
)
def test_expected_max_normal_matches_the_tables(count, value):
    assert expected_max_normal(count) == pytest.approx(value, abs=1e-4)


def test_expected_last_of_like_requests_is_their_mean_plus_z_deviations():
    rounds, var = np.full((64, 2), 10.0), np.array([[4.0, 0.0]] * 64)
    got = expected_last(rounds, var)
    assert got[0] == pytest.approx(10.0 + expected_max_normal(64) * 2.0) and got[1] == pytest.approx(10.0)
    assert expected_last(np.array([[3.0, 7.0]]), np.array([[9.0, 9.0]])).tolist() == [3.0, 7.0]  # alone


def test_expected_last_ignores_requests_far_ahead_of_the_slowest():
    var = np.full((8, 1), 1.0)
    one_slow = np.array([[5.0]] * 7 + [[50.0]])
    assert expected_last(one_slow, var)[0] == pytest.approx(50.0, abs=1e-6)


def test_steady_call_seconds_of_autoregressive_steps_are_exact():
    costs = np.array([1e-3, 2e-3])
    remaining = np.array([10.0, 30.0, 20.0])
    ybar, var = np.array([0.0, 3.0]), np.array([0.0, 0.0])
    pace, pace_var = np.array([1.0, 2.0, 1.0]), np.zeros(3)
    got = steady_call_seconds(costs, remaining, ybar, var, pace, pace_var)
    assert got[0] == pytest.approx(30e-3)  # the longest request, one token a step
    assert got[1] == pytest.approx(2e-3 * max(10 / 4, 30 / 7, 20 / 4))  # mu = 1 + pace * ybar
    wider = steady_call_seconds(costs, remaining, ybar, var, pace, np.full(3, 0.2))
    assert wider[0] == got[0] and wider[1] > got[1]  # an unknown pace lengthens the expected tail


def test_paces_are_a_posterior_around_one_and_the_spread_is_learnt_across_calls():
    paces = Paces()
    paces.rows(3)
    paces.observe(np.array([0, 1, 2]), np.array([10.0, 20.0, 30.0]), 20.0, 0.0)
    pace, var = paces.estimate(np.array([0, 1, 2]))
    assert pace.tolist() == [1.0, 1.0, 1.0] and var.tolist() == [0.0, 0.0, 0.0]  # no spread learnt yet
    paces.new_call()  # ratios 0.5, 1, 1.5 without noise
    assert paces.spread == pytest.approx(np.var([0.5, 1.0, 1.5])) and paces.calls == 1
    paces.rows(2)
    paces.observe(np.array([0, 1]), np.array([4.0, 4.0]), 2.0, 2.0)  # ratio 2, noise 2 / 2^2 = 0.5
    pace, var = paces.estimate(np.array([0, 1]))
    weight = paces.spread / (paces.spread + 0.5)
    assert pace[0] == pytest.approx(1 + weight) and var[0] == pytest.approx(paces.spread * (1 - weight))


def _measured(policy: BudgetPolicy, costs: dict[int, float]) -> None:
    for k, seconds in costs.items():
        for _ in range(MIN_COST_ROUNDS):
            policy.costs.observe(k, seconds)


def _policy_after_a_round(costs: dict[int, float], batch: int, accepted: float, rounds: int = 1,
                          spread: float = 0.0) -> BudgetPolicy:  # fmt: skip
    """A policy that has every bucket's cost and has read `rounds` bucket-8 rounds of `batch` requests,
    each request accepting `accepted` drafted tokens on average, `spread` more and less in turn, and
    bucket 4 half as many on the same drafts."""
    policy = BudgetPolicy(AUTO_BUCKETS, depth=64)
    _measured(policy, costs)
    # an earlier draft built every bucket, the larger trees at S 0 (estimated as if never built: E 1);
    # a call is given to steps only once every tree has been built (BudgetPolicy._unbuilt)
    policy.calibration.observe_drafts(np.tile([0.0, 1.0, 2.0, 0.0, 0.0, 0.0], (batch, 1)))
    for r in range(rounds):
        _round_of_8(policy, accepted + spread * np.where((np.arange(batch) + r) % 2 == 0, 1.0, -1.0))
    return policy


def _round_of_8(policy: BudgetPolicy, got: np.ndarray, seconds: float | None = None) -> None:
    """One bucket-8 round read (picked first) of len(got) requests, each accepting its `got` drafted
    tokens, bucket 4 half as many on the same draft."""
    batch = got.size
    policy.pick([True] * batch, must_draft=True)
    sums = np.tile([0.0, 1.0, 2.0, np.nan, np.nan, np.nan], (batch, 1))
    would = np.stack([np.ones(batch), 1 + got / 2, 1 + got] + [np.full(batch, np.nan)] * 3, axis=1)
    policy.observe(8, seconds, list(range(batch)), 1 + got, sums, would)


def test_a_static_call_steps_when_steps_end_it_soonest():
    """Trees commit a little more per second than steps, summed over the requests (the rule alone
    drafts), but at 64 requests their spread makes the last one finish later than 127 steps would."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 64, accepted=1.2, rounds=40, spread=1.2)  # known well
    active = [True] * 64
    assert policy.pick(active, must_draft=False) != 0  # refilled rows: the rule alone
    policy.pending.clear()
    assert policy.pick(active, must_draft=False, remaining=[127] * 64) == 0
    assert policy.pick(active, must_draft=True, remaining=[127] * 64) != 0  # the drafter must run
    assert not policy.stepping  # a close answer does not give the call to steps


def test_greedy_copies_count_once_in_the_calls_tail():
    """The same 64 requests in a new call told that the rows of each parity are greedy copies (one
    prompt each, so they commit the same tokens every round, as the rounds above had them accept): the
    tail is that of 2 requests, not of 64 independent ones, and trees end the call sooner; untold, steps."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    told = _policy_after_a_round(costs, 64, accepted=1.2, rounds=40, spread=1.2)
    told.new_call(copies=[b % 2 for b in range(64)])
    assert told.pick([True] * 64, must_draft=False, remaining=[127] * 64) != 0
    untold = _policy_after_a_round(costs, 64, accepted=1.2, rounds=40, spread=1.2)
    untold.new_call()
    assert untold.pick([True] * 64, must_draft=False, remaining=[127] * 64) == 0


def test_a_decisive_answer_for_steps_gives_the_call_to_steps():
    """Steps far cheaper per token than any tree: the call is given to steps at once, even where the
    drafter would have to run (a call's first round, a full context), and stays so until the next call."""
    costs = {0: 1.0, 4: 3.0, 8: 3.2, 16: 3.5, 32: 4.0, 64: 5.0}
    policy = _policy_after_a_round(costs, 4, accepted=0.2)
    active, left = [True] * 4, [120] * 4
    assert policy.pick(active, must_draft=True, remaining=left) == 0 and policy.stepping
    assert [policy.pick(active, must_draft=True, remaining=[k] * 4) for k in (119, 20, 1)] == [0, 0, 0]
    policy.new_call()
    assert not policy.stepping


def test_a_bucket_never_measured_does_not_keep_a_call_from_steps():
    """Steps far cheaper per token than every tree measured, bucket 4 never run (no cost): the call is
    given to steps at its first pick, where the rule alone would try bucket 4 first; with a close answer
    (not decisive) the rule still tries it."""
    costs = {0: 1.0, 8: 3.2, 16: 3.5, 32: 4.0, 64: 5.0}
    policy = _policy_after_a_round(costs, 4, accepted=0.2)
    assert policy.costs.estimate(4) == 0.0
    active, left = [True] * 4, [120] * 4
    assert policy.pick(active, must_draft=False) == 4  # the rule: an unmeasured bucket is tried
    policy.pending.clear()
    assert policy.pick(active, must_draft=True, remaining=left) == 0 and policy.stepping
    close = _policy_after_a_round({0: 1.0, 8: 1.2, 16: 1.3, 32: 1.5, 64: 1.8}, 4, accepted=0.3)
    assert close.pick(active, must_draft=False, remaining=left) == 4 and not close.stepping


def test_a_call_given_to_steps_picks_without_weighing(monkeypatch):
    """Once a call is given to steps, its picks do none of the choice's per-round work (no estimate,
    no cost, no call test: host time a call of plain steps does not pay), and its steps are read and
    priced as before."""
    costs = {0: 1.0, 4: 3.0, 8: 3.2, 16: 3.5, 32: 4.0, 64: 5.0}
    policy = _policy_after_a_round(costs, 4, accepted=0.2)
    active, left = [True, True, False, True], [120] * 4
    assert policy.pick(active, must_draft=True, remaining=left) == 0 and policy.stepping

    def weighed(*args, **kwargs):
        raise AssertionError("a call given to steps weighed its round")

    for name in ("expected", "long_run", "long_run_values"):
        monkeypatch.setattr(policy.calibration, name, weighed)
    monkeypatch.setattr(policy.costs, "estimates", weighed)
    assert [policy.pick(active, must_draft=False, remaining=left) for _ in range(3)] == [0, 0, 0]
    assert policy.streak == 4 and len(policy.pending) == 4
    for _ in range(4):
        policy.observe(0, 0.5, [0, 1, 3], [1, 1, 0, 1], None)
    assert not policy.pending and policy.chosen[0] == 4 and policy.report()[0]["rounds"] == 4


def test_a_tree_known_from_few_rounds_is_explored_before_steps_take_over():
    """Steps beat bucket 8 at its estimate from two rounds of one request, not at its upper bound (the
    estimate plus EXPLORE_SDS standard errors): the rule drafts where it would have stepped, and a
    static call steps but is not given to steps (its later rounds may still draft and teach the
    estimate; without the bound both would step for good: steps teach nothing about trees). Many
    rounds of the same evidence shrink the bound: the rule steps, the call is given to steps."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 1, accepted=0.6, rounds=2)
    ybar, _ = policy.calibration.long_run()
    assert (1 + ybar[2]) / costs[8] < 1 / costs[0] < (1 + ybar[2] + policy.calibration.bonus()[2]) / costs[8]
    assert policy.pick([True], must_draft=False) != 0
    assert policy.pick([True], must_draft=False, remaining=[120]) == 0 and not policy.stepping
    policy = _policy_after_a_round(costs, 1, accepted=0.6, rounds=400)
    assert policy.pick([True], must_draft=False) == 0
    assert policy.pick([True], must_draft=False, remaining=[120]) == 0 and policy.stepping


def test_a_static_call_drafts_when_trees_pay_for_their_tail():
    costs = {0: 1.0, 4: 1.2, 8: 1.3, 16: 1.4, 32: 1.6, 64: 2.0}
    policy = _policy_after_a_round(costs, 64, accepted=4.0)
    assert policy.pick([True] * 64, must_draft=False, remaining=[127] * 64) != 0


def test_the_rounds_in_flight_count_against_what_is_left():
    """Near the end of a call the rounds picked and not read yet are expected to commit the last
    tokens: a request with 3 tokens left and a round in flight expected to commit 3 has none left, and
    one step ends the call sooner than any tree."""
    costs = {0: 1.0, 4: 1.2, 8: 1.3, 16: 1.4, 32: 1.6, 64: 2.0}
    policy = _policy_after_a_round(costs, 1, accepted=4.0)
    assert policy.pick([True], must_draft=False, remaining=[40]) != 0
    assert policy.pick([True], must_draft=False, remaining=[3]) == 0


def test_a_decisive_answer_is_kept_for_a_few_rounds_but_not_near_the_end():
    test = CallTest(depth=64)
    assert test.decide(np.array([1.0, 2.0, 3.0]), 0, most=200.0)  # steps: twice as fast
    assert [test.kept_answer(150.0) for _ in range(KEEP_ROUNDS)] == [True] * KEEP_ROUNDS
    assert test.kept_answer(150.0) is None  # served its rounds
    test.decide(np.array([1.0, 2.0, 3.0]), 0, most=200.0)
    assert test.kept_answer(99.0) is None  # under half what was left at the test
    test.decide(np.array([1.0, 2.0, 3.0]), 0, most=100.0)
    assert test.kept_answer(63.0) is None  # in the last `depth` tokens
    assert not test.decide(np.array([1.1, 1.0, 3.0]), 0, most=200.0)  # trees a little faster: not kept
    assert test.kept_answer(200.0) is None


def test_the_calls_test_prices_steps_at_what_steps_in_a_row_cost():
    """Steps read between tree rounds cost 1.8 (they carry the host's work for the trees), steps read
    after a step 1.0: trees at 2.0 commit 1.5 tokens a round, so steps end the call sooner at 1.0 a
    token, not at 1.8; the call's test takes the steady price, the cost table keeps the mixed one."""
    costs = {0: 1.8, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    active, left = [True] * 4, [120] * 4
    untold = _policy_after_a_round(costs, 4, accepted=0.5, rounds=400)
    assert untold.pick(active, must_draft=False, remaining=left) != 0  # no steady step measured
    policy = _policy_after_a_round(costs, 4, accepted=0.5, rounds=400)
    policy.observe(0, 1.8, range(4), [1] * 4, None)  # a step after a tree round: not steady
    assert policy.step_costs.estimate(0) == 0.0
    for _ in range(MIN_COST_ROUNDS):
        policy.observe(0, 1.0, range(4), [1] * 4, None)  # steps in a row
    assert policy.costs.estimate(0) == pytest.approx(1.8) and policy.step_costs.estimate(0) == 1.0
    assert policy.pick(active, must_draft=False, remaining=left) == 0
    policy.new_call()  # a new call's first read follows no step
    policy.observe(0, 5.0, range(4), [1] * 4, None)
    assert policy.step_costs.estimate(0) == 1.0


def test_a_call_of_steps_after_a_tree_pays_the_tables_price_for_its_first_step():
    """Steps in a row cost 1.0, a step after a tree round 1.8; trees at 2.0 commit 1.8 tokens a round.
    With 2 tokens left after a tree, steps take 1.8 + 1.0 against one tree round's 2.0 or so: the tree;
    after a step, two more steps take 2.0 against the tree's 2.2: the steps."""
    costs = {0: 1.8, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 1, accepted=0.8, rounds=400)
    policy.observe(0, 1.8, [0], [1], None)
    for _ in range(MIN_COST_ROUNDS):
        policy.observe(0, 1.0, [0], [1], None)  # steps in a row
    assert policy.step_costs.estimate(0) == 1.0 and policy.costs.estimate(0) == pytest.approx(1.8)
    policy.pick([True], must_draft=True)  # the last pick a tree, read
    sums, would = np.array([[0.0, 1.0, 2.0] + [np.nan] * 3]), np.array([[1.0, 1.4, 1.8] + [np.nan] * 3])
    policy.observe(8, None, [0], [1.8], sums, would)
    assert policy.pick([True], must_draft=False, remaining=[2]) != 0
    assert policy.pick([True], must_draft=False, remaining=[1]) == 0  # one step beats any tree
    assert policy.pick([True], must_draft=False, remaining=[2]) == 0  # after a step: no switch to pay


def _why_read(policy: BudgetPolicy, bucket: int, batch: int) -> str:
    """The reason the round just picked carries to its read (BudgetPolicy.last_pick), read as a round
    of `batch` requests that committed one token each."""
    policy.observe(bucket, None, list(range(batch)), [1] * batch, None)
    why, expected = policy.last_pick.why, policy.last_pick.batch_expected
    assert (expected is None) == (why == "stepping")
    ruled = why in ("rule", "untried", "explore")  # the per-round rule weighed the costs at a rate
    assert (policy.last_pick.rate is not None) == ruled == (policy.last_pick.costs is not None)
    return why


def test_each_round_read_says_which_part_of_the_policy_picked_it():
    """The round log's reasons (PICK_REASONS), each from the setting of a test above: a bucket never
    measured is tried ("untried"), the rule's own choice ("rule"), a step the upper bounds turned into a
    tree ("explore"), the static call's test ("call", also the step that gives a call to steps) and the
    later rounds of a call given to steps ("stepping"); the batch's expected tokens at every bucket come
    with each but the last."""
    costs = {0: 1.0, 8: 3.2, 16: 3.5, 32: 4.0, 64: 5.0}
    policy = _policy_after_a_round(costs, 4, accepted=0.2)
    assert policy.pick([True] * 4, must_draft=False) == 4 and _why_read(policy, 4, 4) == "untried"
    assert policy.pick([True] * 4, must_draft=True, remaining=[120] * 4) == 0 and policy.stepping
    assert _why_read(policy, 0, 4) == "call"  # the test that gave the call to steps
    assert policy.pick([True] * 4, must_draft=False, remaining=[119] * 4) == 0
    assert _why_read(policy, 0, 4) == "stepping"
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 1, accepted=0.6, rounds=2)
    tree = policy.pick([True], must_draft=False)
    assert tree != 0 and _why_read(policy, tree, 1) == "explore"
    assert policy.pick([True], must_draft=False, remaining=[120]) == 0 and _why_read(policy, 0, 1) == "call"
    policy = _policy_after_a_round(costs, 1, accepted=0.6, rounds=400)
    assert policy.pick([True], must_draft=False) == 0 and _why_read(policy, 0, 1) == "rule"
    assert set(PICK_REASONS) == {"untried", "stepping", "explore", "call", "rule", "probe"}


def _close_call_picks(rounds: int, copies: int = 1) -> list[tuple[int, str]]:
    """(bucket, why) of `rounds` picks of a call of one request (or `copies` greedy copies of one) whose
    test answers steps, not decisively (the setting above), each read as a round that committed one
    token a request."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 1, accepted=0.6, rounds=2)
    policy.new_call(copies=[0] * copies)
    picks = []
    for left in range(120, 120 - rounds, -1):
        k = policy.pick([True] * copies, must_draft=False, remaining=[left] * copies)
        picks.append((k, _why_read(policy, k, copies)))
    assert not policy.stepping
    return picks


def test_the_tests_steps_in_a_row_are_probed_by_a_tree(monkeypatch):
    """A close answer for steps (the call not given to steps) steps PROBE_STEPS rounds in a row, then
    drafts the tree of most tokens per second at the trees' estimates ("probe"), then steps again;
    without the probe it would step throughout, learning nothing of the trees."""
    picks = _close_call_picks(2 * PROBE_STEPS + 3)
    steps = [(0, "call")] * PROBE_STEPS
    assert picks[:PROBE_STEPS] == steps and picks[PROBE_STEPS + 1 : 2 * PROBE_STEPS + 1] == steps
    assert picks[PROBE_STEPS][0] > 0 and picks[PROBE_STEPS][1] == "probe"
    assert picks[2 * PROBE_STEPS + 1][1] == "probe"
    assert _close_call_picks(2 * PROBE_STEPS + 3, copies=3) == picks  # greedy copies: one request
    monkeypatch.setattr(budget, "PROBE_STEPS", 10**6)
    assert _close_call_picks(2 * PROBE_STEPS + 3) == [(0, "call")] * (2 * PROBE_STEPS + 3)


def test_with_more_than_one_request_the_tests_steps_are_not_probed():
    """64 requests whose test answers steps, not decisively, because of the tail (the first test's
    setting): no probe, however many steps in a row (a probe's round, read as the trees' rate, would
    turn the call back to trees that the tail makes slower)."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 64, accepted=1.2, rounds=40, spread=1.2)
    picks = []
    for left in range(127, 127 - 2 * PROBE_STEPS - 3, -1):
        k = policy.pick([True] * 64, must_draft=False, remaining=[left] * 64)
        picks.append((k, _why_read(policy, k, 64)))
    assert picks == [(0, "call")] * (2 * PROBE_STEPS + 3) and not policy.stepping


def test_with_more_than_one_request_the_tests_steps_in_a_row_settle_the_call_on_steps():
    """The same 64 requests: the close answer steps SETTLED_STEPS rounds in a row ("call"), the last of
    them giving the call to steps, and every later round is a step of a call given to steps (no forced
    draft, plain decoding's step). One request's close answer is probed every PROBE_STEPS + 1 rounds
    first, so its call is never given to steps that way."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = _policy_after_a_round(costs, 64, accepted=1.2, rounds=40, spread=1.2)
    picks = []
    for left in range(127, 127 - SETTLED_STEPS - 3, -1):
        k = policy.pick([True] * 64, must_draft=False, remaining=[left] * 64)
        picks.append((k, _why_read(policy, k, 64)))
        assert policy.stepping == (len(picks) >= SETTLED_STEPS)
    assert picks == [(0, "call")] * SETTLED_STEPS + [(0, "stepping")] * 3 and policy.stepping
    one = _close_call_picks(2 * SETTLED_STEPS)  # (asserts that the call was not given to steps)
    assert {why for _, why in one} == {"call", "probe"}


@pytest.mark.parametrize("batch", [1, 4])
def test_a_call_is_not_given_to_steps_while_a_tree_was_never_built(batch):
    """Steps far cheaper than every tree, but no draft has built buckets 16-64 (only bucket 8 has run):
    their E is a step's for want of any S, not for being poor, so the test's decisive answer steps this
    round without giving the call to steps; after PROBE_STEPS such steps the probe drafts the largest
    tree never built (one round of it tells every smaller bucket's S), at any batch; once it is read,
    the call is given to steps."""
    policy = BudgetPolicy(AUTO_BUCKETS, depth=64)
    _measured(policy, {0: 1.0, 4: 3.0, 8: 3.2, 16: 3.5, 32: 4.0, 64: 5.0})
    rows, active, left = list(range(batch)), [True] * batch, [120] * batch
    sums = np.tile([0.0, 1.0, 2.0, np.nan, np.nan, np.nan], (batch, 1))
    policy.pick(active, must_draft=True)
    policy.observe(8, None, rows, [1.2] * batch, sums, np.tile([1.0, 1.1, 1.2] + [np.nan] * 3, (batch, 1)))
    for _ in range(PROBE_STEPS):
        assert policy.pick(active, must_draft=False, remaining=left) == 0 and not policy.stepping
        policy.observe(0, None, rows, [1] * batch, None)
    assert policy.pick(active, must_draft=False, remaining=left) == 64 and policy.pending[-1].why == "probe"
    told = np.tile([1.0, 1.1, 1.2, 1.2, 1.3, 1.3], (batch, 1))
    policy.observe(64, None, rows, [1.3] * batch, np.tile([0.0, 1.0, 2.0, 2.2, 2.4, 2.5], (batch, 1)), told)
    assert policy.pick(active, must_draft=False, remaining=left) == 0 and policy.stepping


def test_estimates_refresh_every_k_rounds_read_and_at_a_buckets_first_of_its_kind():
    """refresh_rounds = 3: the fit and the cost table the choice weighs stay as they were between refreshes
    and take every round read in at the third; a bucket's first pairs (and the round that first gives a
    bucket its median price) refresh at once. With refresh_rounds = 1 every round does."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    held = BudgetPolicy(AUTO_BUCKETS, depth=64, refresh_rounds=3)
    _measured(held, costs)
    held.calibration.observe_drafts(np.tile([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], (2, 1)))
    _round_of_8(held, np.full(2, 2.0), 4.0)  # bucket 8's (and 4's) first pairs: at once
    fit, prices = held.calibration.expected_coefficients(), held.costs.estimates()
    assert fit[0][2] > 1.0  # fitted from the round (1 + its mean accepted, shrunk): no pairs gives 1
    _round_of_8(held, np.full(2, 5.0), 4.0)  # more accepted, dearer: still the first's estimates
    assert held.calibration.expected_coefficients() is fit and held.costs.estimates() is prices
    _round_of_8(held, np.full(2, 5.0), 4.0)  # the third round read: all three taken in
    assert held.calibration.expected_coefficients()[0][2] > fit[0][2]
    assert prices[1][2] == 2.0 and held.costs.estimates()[1][2] == 3.0  # the median of 2, 2, 2, 4, 4, 4
    every = BudgetPolicy(AUTO_BUCKETS, depth=64)
    _measured(every, costs)
    every.calibration.observe_drafts(np.tile([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], (2, 1)))
    _round_of_8(every, np.full(2, 2.0), 2.0)
    fit = every.calibration.expected_coefficients()
    _round_of_8(every, np.full(2, 5.0), 4.0)
    assert every.calibration.expected_coefficients() is not fit
    new = BudgetPolicy(AUTO_BUCKETS, depth=64, refresh_rounds=3)
    new.costs.observe(8, 2.0)
    new.costs.observe(8, 2.0)
    assert new.costs.estimate(8) == 0.0  # not measured MIN_COST_ROUNDS times yet
    new.costs.observe(8, 2.0)  # its third: priced at once
    assert new.costs.estimate(8) == 2.0


def test_a_deferred_refresh_waits_for_refresh_when_due_and_readies_the_next_pick():
    """defer_refresh (the engine's): a refresh that comes due in observe waits for refresh_when_due,
    which takes every round read in and derives what the next pick weighs (its standing is the one
    the pick then uses); nothing due, it does nothing. A bucket's first pairs still refresh at once."""
    costs = {0: 1.0, 4: 1.9, 8: 2.0, 16: 2.2, 32: 2.6, 64: 3.4}
    policy = BudgetPolicy(AUTO_BUCKETS, depth=64, refresh_rounds=3, defer_refresh=True)
    _measured(policy, costs)
    policy.calibration.observe_drafts(np.tile([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], (2, 1)))
    _round_of_8(policy, np.full(2, 2.0), 4.0)  # bucket 8's first pairs: at once
    fit = policy.calibration.expected_coefficients()
    assert fit[0][2] > 1.0
    for _ in range(3):
        _round_of_8(policy, np.full(2, 5.0), 4.0)
    assert policy.calibration.expected_coefficients() is fit  # due since the third, left for later
    assert policy.costs.estimates()[1][2] == 2.0
    assert policy.refresh_when_due([True, False, True])
    assert policy.calibration.expected_coefficients()[0][2] > fit[0][2]
    assert policy.costs.estimates()[1][2] == 4.0  # the median of 2, 2, 2, 4, 4, 4, 4
    kept = policy._standing_kept
    assert kept is not None and 2 in kept.rates  # the steady rate of the two running rows, derived
    assert not policy.refresh_when_due([True, True])  # nothing due
    policy.pick([True, True], must_draft=False)
    assert policy._standing_kept is kept  # the pick weighed what the refresh derived


def test_held_rounds_wait_for_the_refresh_and_add_up_to_the_same_sums():
    """Held, a round whose pairs and drafts are no bucket's first waits and is added to the sums at the
    next refresh (or before anything reads them), all waiting rounds in one pass: after the refresh the
    sums, levels and fit equal those of a calibration that added every round at once. A bucket's first
    pairs or draft is added at once, held or not."""
    from kdtree_engine.engine.budget_estimates import Calibration

    rng = np.random.default_rng(5)
    held, every = Calibration(AUTO_BUCKETS), Calibration(AUTO_BUCKETS)
    held.held = True
    columns = np.array([1, 2])  # buckets 4 and 8: what a round of 16 tells of its smaller trees

    def draft(rows):  # the S of a round of bucket 16 (NaN past it)
        s = np.cumsum(rng.uniform(0.0, 1.5, (rows, 6)), axis=1)
        s[:, 0], s[:, 4:] = 0.0, np.nan
        return s

    def round_of_16(cal, s, seen, accepted, would, fit):
        cal.observe_choices(3, seen, accepted, np.maximum(1.0, seen))
        cal.observe_nested(columns, np.tile(seen[:, None], 2), would, s[:, columns], fit)
        cal.observe(3, accepted, s[:, 3])
        cal.observe_drafts(s)

    first = [draft(3), rng.uniform(0, 4, 3), rng.integers(0, 4, 3).astype(float), rng.uniform(0, 2, (3, 2))]
    for cal in (held, every):
        round_of_16(cal, *first, cal.expected_coefficients())
    assert held.n[3] == every.n[3] == 3 and held.drafts[3] == every.drafts[3] == 3  # firsts: at once
    fit = held.expected_coefficients()
    for rows in (2, 4, 1):
        s, seen = draft(rows), rng.uniform(0, 4, rows)
        accepted, would = rng.integers(0, 4, rows).astype(float), rng.uniform(0, 2, (rows, 2))
        round_of_16(held, s, seen, accepted, would, fit)
        round_of_16(every, s, seen, accepted, would, fit)
    assert held.n[3] == 3 and held.n[1] == 3 and held.drafts[3] == 3  # waiting
    assert held.expected_coefficients() is fit  # kept until the refresh
    held.refresh()
    every.refresh()
    assert held.sums == pytest.approx(every.sums, rel=1e-12)
    assert held.level_sums == pytest.approx(every.level_sums, rel=1e-12)
    assert (held.drafts == every.drafts).all()
    for mine, theirs in zip(held.expected_coefficients(), every.expected_coefficients(), strict=True):
        assert mine == pytest.approx(theirs, rel=1e-12)
    assert held.long_run()[1] == pytest.approx(every.long_run()[1], rel=1e-12)
    s, seen = draft(2), rng.uniform(0, 4, 2)
    for cal in (held, every):
        round_of_16(cal, s, seen, np.ones(2), np.ones((2, 2)), held.expected_coefficients())
    assert held.n[3] == every.n[3] - 2  # waiting again
    assert held.slopes() == pytest.approx(every.slopes(), rel=1e-12)  # a read of the sums takes it in
    assert held.n[3] == every.n[3]


def test_one_requests_call_seconds_are_the_general_forms():
    """steady_call_seconds of one request takes its rounds directly (expected_last of one row weighs no
    spread): the same seconds as the general form, NaN and ties included."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        costs = rng.choice([0.0, 1.0, 2.5], 6)
        ybar, var = rng.choice([0.0, 0.5, 3.0, np.nan], 6), rng.random(6)
        remaining, pace, pace_var = rng.choice([1.0, 7.0, np.nan], 1), rng.random(1) + 0.5, rng.random(1)
        mu = 1.0 + pace[:, None] * ybar
        rounds = remaining[:, None] / mu
        spread = remaining[:, None] * var / mu**3
        general = costs * np.maximum(1.0, expected_last(rounds, spread))
        got = steady_call_seconds(costs, remaining, ybar, var, pace, pace_var)
        np.testing.assert_array_equal(got, general)
