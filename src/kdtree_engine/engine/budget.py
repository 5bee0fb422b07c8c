"""The cost-aware tree budget ("auto"): each round the engine verifies the first n nodes of the draft
tree for the n among a few captured buckets (0 included: an autoregressive step, no drafter forward)
that maximizes the expected committed tokens per second of the whole batch. One more bucket is
DFlash's chain (`auto_buckets`): the top-1 token of each of the drafter's L positions, L nodes, whose
S is the sum of their path probabilities (`chain_sums`); for a drafter whose probabilities understate
its top-1 it beats every best-first tree, and the measured rates then pick it.

The path probabilities. A best-first tree's nodes come out in decreasing draft path probability.
Under sampled DDTree acceptance with a drafter whose distribution is the target's, node i is on the
accepted path with probability p_i, its path probability, so a tree of the first n nodes commits
E(n) = 1 + S(n), S(n) = sum_{i < n} p_i, tokens in expectation (the bonus token included), exactly.
The draft computes p from its own log-softmax along each node's ancestors (`path_probabilities`);
a round builds the tree of its own bucket n only (no larger tree to slice: it costs what a fixed
budget n costs), so it knows S at the buckets up to n, and these sums ride on the round's one
device-to-host copy.

The estimator. The choice of round k + 1 is made before round k is read (the rounds are pipelined),
so it sees each request's S from an earlier round, x = S_b(n) of its last draft read; when `a` rounds
were picked since that read (autoregressive ones: no new S), x is pulled towards the bucket's level
(the mean S of every draft read that built that bucket) by a factor STALE_DECAY^a; a bucket its last
draft did not build is seen at its level. Per bucket, over the (request, round)
pairs that verified it, the engine fits the accepted drafted tokens y (committed - 1) on x:

    E_b(n) = 1 + ybar_n + beta_n * (x_b - xbar_n)

ybar_n: the pairs' mean y, shrunk towards the drafter's calibrated prediction r_n * level_n by
PRIOR_PAIRS pseudo-pairs (one unlucky round does not rule a bucket out); beta_n >= 0: the least-squares
slope, shrunk by n_pairs / (n_pairs + SLOPE_PAIRS). r_n = sum(accepted) / sum(S of the round's own
draft) is the drafter's calibration at bucket n (a bucket not verified yet borrows the nearest one's;
1 before any), and a bucket without pairs is estimated as 1 + r_n * x. Under greedy decoding the
acceptance persists from round to round (the slope carries the last draft's confidence); under
sampling it hardly does, and the fit falls back to the bucket's mean.

The cost. c(n) is the measured time of a round of bucket n at this batch (seconds, the median of the
last rounds of that bucket): on CUDA the host clock between two reads, which with rounds enqueued
ahead is the device's round or the host's work per round, whichever is longer; on the CPU the round's
own wall time. A bucket measured fewer than MIN_COST_ROUNDS times costs 0, so that each gets tried,
the smallest first, until one odd round (a graph's first replay) no longer decides its cost.

The choice. What is to be maximized is the tokens per second of many rounds, sum E / sum c, not of
each round alone: a round whose draft promises little is better spent on a bucket that costs little
only if what it gives up is worth less than its time at the rate the rounds achieve. So each round takes
the bucket with the most expected tokens beyond what its time is worth at the steady rate (Dinkelbach's
rule for a ratio of sums),

    argmax over n of  sum_b E_b(n) - lambda c(n),   lambda = max over n of sum_b E_b(n | level_n) / c(n),

over the requests still running; lambda is the rate of the best bucket used every round, each request
seen at the bucket's level of S (E at a round of average promise). Where the draft tells nothing (E the
same every round) it picks what the ratio sum_b E_b(n) / c(n) picks; where it does, it leaves the
steady bucket only for a round whose extra tokens pay for its extra time. In a static
call (generate(): the engine passes each request's tokens left), first the static call's test
(engine.budget_call): an autoregressive step whenever steps alone would end the call sooner than any
bucket used for every round from here, the last request's tail counted. It prices a step at what a
step read right after a step costs, where that is measured and clearly cheaper (STEADY_STEP_MARGIN)
than the cost table's step: a step read between speculative rounds also carries the host's work for
them (reading, committing and learning from a tree round), which a call of steps does not pay, but for
its first step when it starts after a tree (that one is priced at the table's).

Exploring against steps. An autoregressive step teaches nothing about the trees, so a tree bucket whose
estimate came out low from a few unlucky rounds (a call's first rounds, at the start of its texts)
could keep the policy stepping for good. So every tree bucket's accepted drafted tokens also have an
upper bound, EXPLORE_SDS standard errors above the estimate (`Calibration.bonus`), and where the rule
picks a step while steps are also its steady choice, it drafts instead if a tree is the steady choice
at the upper bounds; the static call's test gives a call to steps (no draft until it ends) only if
steps win decisively against the upper bounds too, while its round-by-round answer uses the estimates
(optimism there, against a batch's tail, costs a batch of 64 that steps best its extra trees). Among
trees the estimates stay as they are (optimism there buys rounds of the larger, costlier buckets).

Probing the test's steps. The static call's test weighs the buckets at their long-run acceptance, not at
what the last draft says, so a close answer for steps (not decisive: the call is not given to steps)
holds round after round, and steps teach nothing: estimates learnt from a text's hard start (or from a
Runner's earlier calls on it) would keep a call stepping through a later part that its trees would
have sped up. So, in a call of one running request (or greedy copies of one), after PROBE_STEPS of the
test's steps in a row the next round drafts the tree of most tokens per second at the trees' estimates
(`_probe`; at their upper bounds it took the least-known, largest trees, which cost most); its round
teaches the calibration that tree's acceptance and, through its nested counts, every smaller tree's.
There the test weighs the steady rates alone, with no tail, and a close answer makes a probe round in
PROBE_STEPS + 1 cheap. Not with more requests: there a close answer for steps is often the tail's
doing, and the probes' rounds, read as the trees' rates, turned calls back to trees that the tail then
made slower (docs/engine.md has the simulator's figures).

Settled steps. A close answer for steps that has held SETTLED_STEPS rounds in a row gives the call to
steps as a decisive one does. The steps teach nothing of the trees, so the answer moves only with the
tokens the requests have left, while each of those steps keeps the drafter's context complete (it costs
more than plain decoding's step; docs/engine.md) and every STEP_ROUNDS (L + 1) of them force a draft of a
tree the answer had ruled out. With one request the probes (every PROBE_STEPS + 1 rounds) come first.

Trees never built. A bucket's level of S is known once a draft has built it (a round of bucket n tells the S
of every bucket up to n). Before that its E is a step's for want of any S, and its upper bound says nothing
either, so a test that gave the call to steps then would judge the trees by the small ones built so far, and a
Runner could give every later call to steps without ever drafting the larger trees (docs/engine.md, "Where it
stands", has the run where one did). So a call is given to steps only once every candidate tree has been built
(`_unbuilt`); until then a decisive answer steps round by round, and after PROBE_STEPS of them the probe, at
any batch, drafts the largest tree never built: once per Runner, its one round tells every smaller bucket's S.

The chain at its lower bound. Only the chain's own rounds tell what it commits (a tree round tells its S,
not its count), while every tree is also told by each larger tree's round: its estimate rests on fewer
pairs, and a choice that takes it whenever that estimate comes out above the trees' takes it on its
errors (the winner's curse; docs/notes/engine.md). So in the per-round choice the chain's E counts
EXPLORE_SDS standard errors below its estimate (Calibration.bonus), at least 1: it takes rounds from the
trees once its own rounds have shown it better. The steady rate (lambda) and the steady choice weigh it
the same way: an estimate the choice does not act on must not set the rate every round's time is
charged at.

The chain only where the drafter understates its top-1. The best-first tree of n nodes holds the n
paths of highest draft probability, so its S is at least the chain's at n >= L nodes; where the
chain's paths are calibrated (it commits 1 + S in expectation), the tree of the next bucket up, at about
the chain's cost, commits at least as much. The chain wins only where its rounds accept well beyond
what their S predicted (a flat drafter whose top-1 is right far more often than it says, and whose
trees go wide). So the chain is a candidate (in the choice, its steady rate, the exploring and the
static call's test) only while its own rounds accepted at least CHAIN_MIN_RATIO times the drafted tokens
their S predicted (Calibration.own_ratio; before its first round, it is). The ratios measured for
kimi-nano's drafter and the scaled-down Kimi's stand-in are in docs/engine.md.

Identical greedy requests. Greedy requests with the same prompt and limit commit the same tokens every
round, so the static call's tail counts them once (`new_call(copies=...)`): a batch of 64 that repeats
8 prompts ends with its slowest prompt, not with the slowest of 64 independent draws.

The host's time. The policy's pick and observe are host work every round, and at small batch a round
of kimi-nano's is short enough that the host bounds it (docs/engine.md, "Where it stands"). Most of
that work recomputes what every round read changes a little: the fit, the long run and its bounds,
the levels of S, the cost table's prices. With `refresh_rounds` = k those are recomputed every k
rounds read (the engine's: REFRESH_ROUNDS), from every round read: between refreshes the choice weighs
estimates up to k - 1 rounds old, while each request's own S is always its last draft's. A round that
changes what kind of estimate a bucket gets (its first pairs, draft or prediction; its third measured
round, which gives it a median price) refreshes at once. Between refreshes a round's pairs and drafts
wait, and the refresh adds the waiting rounds to the calibration's sums in one pass (Calibration:
the same sums, one numpy pass in place of one per round). What the choice derives from those
estimates (the levels with unknown ones at 0, the buckets the rule may take and their prices, whether
one is unmeasured, the steady rate) is kept with them (BudgetPolicy._standing), so that the picks
between refreshes only do each round's own work over its rows; observe sums a few rows' values in
Python floats (total_of: the same floats as numpy's sums). In the simulator, auto over the best at
k = 1, 2, 4 and 8 differs by no more than the spread between seeds (docs/engine.md); k = 1, the
default, is what the policy's tests check.

Deferred refreshes. A refresh costs the host several rounds' worth of pick and observe at once. Done in
observe, it sits between a round's read and the next round's enqueue, where the device has one round
queued: where it outlasts that round, every k-th round costs more (a period of k in the measured round
times; docs/engine.md has the figures). With `defer_refresh` (the engine's) observe leaves a due
refresh to refresh_when_due(), which the engine calls after it enqueues the next round, while the device
has two rounds queued; it also derives what the next pick weighs (_standing, the steady rate), so that
the pick after a refresh costs what any other does. The choice then weighs estimates one round older.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kdtree_engine.engine.budget_call import CallTest, Paces, Pair, steady_call_seconds
from kdtree_engine.engine.budget_estimates import Calibration, CostTable
from kdtree_engine.impl import resolve_impl
from kdtree_engine.ref.round_report import ReportCodes, round_report_ref, smaller_trees
from kdtree_engine.tree_types import DraftTree

AUTO_BUCKETS = (0, 4, 8, 16, 32, 64)  # nodes verified per round besides the root
STEP_ROUNDS = 4  # the drafter's context holds a round's rows and this many rounds' more: AR steps in a row
STALE_DECAY = 0.5  # per autoregressive round, how much of a request's last S survives
CHAIN_MIN_RATIO = 1.5  # the chain's accepted over predicted drafted tokens below which it is out
STEADY_STEP_MARGIN = 0.9  # steps in a row price the call's steps once below this share of the table's
REFRESH_ROUNDS = 4  # the engine's BudgetPolicy.refresh_rounds (the module docstring, "The host's time")
PROBE_STEPS = 8  # the static call's test's steps in a row (one request, not given to steps) before a tree
SETTLED_STEPS = 32  # the static call's test's steps in a row that give the call to steps
FEW_ROWS = 4  # request rows up to which observe() sums them in Python floats (total_of; at most 7)


def auto_buckets(chain_nodes: int | None) -> tuple[int, ...]:
    """The auto budget's buckets for a drafter of L = chain_nodes drafted positions: AUTO_BUCKETS and
    DFlash's chain of L nodes (bucket L: L nodes verified besides the root, node i the top-1 of drafted
    position i), in order of size. No chain where a tree bucket has L nodes (the bucket is its size) or
    L exceeds the largest bucket (a call's buffers are sized for that one)."""
    if (
        chain_nodes is None
        or chain_nodes < 1
        or chain_nodes in AUTO_BUCKETS
        or chain_nodes > max(AUTO_BUCKETS)
    ):
        return AUTO_BUCKETS
    return tuple(sorted((*AUTO_BUCKETS, chain_nodes)))


def chain_bucket(buckets: Sequence[int]) -> int | None:
    """DFlash's chain among the auto budget's `buckets` (auto_buckets: the one not in AUTO_BUCKETS), or
    None."""
    return next((k for k in buckets if k not in AUTO_BUCKETS), None)


def round_report(
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    tree: DraftTree,
    visibility: torch.Tensor,
    accepted: torch.Tensor,
    codes: ReportCodes,
    impl: str | None = None,
) -> torch.Tensor:
    """round_report_ref, on CUDA in one launch (kernels.round_report; `impl` as every op's). Internal to
    the engine: its inputs are the round's own tensors, not checked."""
    if resolve_impl(impl, accepted.device) == "ref":
        return round_report_ref(top_logprobs, top_ids, tree, visibility, accepted, codes)
    from kdtree_engine.kernels.round_report import round_report as kernel_report

    return kernel_report(top_logprobs, top_ids, tree, visibility, accepted, codes.sums, codes.would)


def choose(expected: Sequence[float], costs: Sequence[float], rate: float) -> int:
    """The index of the bucket with the most expected tokens beyond what its cost is worth at `rate`
    (tokens per second: the steady rate, module docstring); a bucket of cost 0 (never measured) first,
    the smallest such (exploration); ties: the smaller."""
    best, most = 0, None
    for j, (e, c) in enumerate(zip(expected, costs)):
        if c <= 0:
            return j
        value = e - rate * c
        if most is None or value > most:  # a later bucket only when strictly better
            best, most = j, value
    return best


def total_of(values: np.ndarray) -> float:
    """float(values.sum()) of a 1-D array, for up to FEW_ROWS values in Python floats: numpy adds fewer
    than 8 values one after another to 0.0 (its pairwise summation starts at 8), as this loop does, so
    the same float; where values are few, a numpy call costs more than the additions."""
    if values.size > FEW_ROWS:
        return float(values.sum())
    total = 0.0
    for value in values.tolist():
        total += value
    return total


def steady_rate(at_levels: Sequence[float], costs: Sequence[float]) -> float:
    """The tokens per second of the best bucket used every round: at_levels [buckets], the batch's
    expected tokens per round of each bucket at its level of S; costs [buckets] > 0, its seconds."""
    return max(e / c for e, c in zip(at_levels, costs, strict=True))


PICK_REASONS = ("rule", "untried", "explore", "call", "stepping", "probe")  # why a round got its bucket


@dataclass
class _Choice:
    """What the choice of one enqueued round saw: the running request rows, their S at every bucket
    (aged; [rows, buckets]), and the E each expected at the bucket chosen; for the round log (`why`
    and `batch_expected`, BudgetPolicy.last_pick): which part of the policy decided it (PICK_REASONS:
    the per-round rule; a bucket not measured yet, tried; a step turned into a tree by the upper
    bounds; the static call's test; a call given to steps; a tree drafted after PROBE_STEPS of the
    test's steps) and the batch's E summed at every bucket."""

    rows: np.ndarray
    seen: np.ndarray
    expected: np.ndarray
    why: str = "rule"
    batch_expected: np.ndarray | None = None  # [buckets]; None in a call given to steps
    rate: float | None = None  # the steady rate lambda the rule weighed costs at (tokens per second)
    costs: list[float] | None = None  # the seconds per round it priced each bucket at


@dataclass
class _Standing:
    """What the choice derives from the estimates it weighs (the calibration's kept results, the cost
    table's estimates) and the candidate buckets, kept while they stand (BudgetPolicy._standing): the
    levels of S (Calibration.levels; `known`: 0 where unknown; `unknown`: the mask, None where all are
    known), whether a candidate is unmeasured, whether the static call's test can price a call, the
    buckets the per-round rule may take and their costs (per must_draft), and the steady rate per
    count of requests (filled at its first use: it reads Calibration.bonus, whose first read after a
    refresh takes the waiting rounds in)."""

    key: tuple
    levels: np.ndarray
    known: np.ndarray
    unknown: np.ndarray | None
    unmeasured: bool
    priced: bool
    allowed: dict[bool, tuple[list[int], list[float]]]
    rates: dict[int, float] = field(default_factory=dict)


@dataclass
class BudgetPolicy:
    """The host side of the auto budget for one Runner (its cost table and calibration carry over to
    its later calls): picks each round's bucket from the last figures read, and learns from each round
    read (rounds are read in the order they were picked). `depth`: the most autoregressive rounds in
    a row (engine.loop: the drafter's context holds the rows of one speculative round and
    STEP_ROUNDS (L + 1) more: depth = STEP_ROUNDS (L + 1)).
    Host work per round: a few numpy operations over [requests, buckets], whatever the batch."""

    buckets: tuple[int, ...]
    depth: int
    calibration: Calibration = field(init=False)
    costs: CostTable = field(init=False)  # this call's timing mode's (new_call)
    step_costs: CostTable = field(init=False)  # steps read right after a step: what a call of steps pays
    # per timing mode (stage timers on, off): (costs, step_costs); a stage-timed round costs more
    _cost_tables: dict[bool, tuple[CostTable, CostTable]] = field(init=False, default_factory=dict)
    paces: Paces = field(init=False)  # each request's pace, the spread between requests (static calls)
    call_test: CallTest = field(init=False)  # the static call's test and its kept answer
    sums: np.ndarray = field(init=False)  # [rows, buckets]: each request row's last S read, NaN: none
    age: np.ndarray = field(init=False)  # [rows]: rounds picked since a row's S was read
    streak: int = 0  # autoregressive rounds enqueued since the last draft
    call_steps: int = 0  # of those, the static call's test's in a row (not a call given to steps)
    stepping: bool = False  # this call is given to autoregressive steps: no draft until it ends
    last_read: int | None = None  # the bucket of this call's last round read
    copies: np.ndarray | None = field(init=False, default=None)  # [rows]: first row of its greedy copies
    pending: deque = field(default_factory=deque)  # _Choice per round picked and not read yet
    chosen: dict[int, int] = field(default_factory=dict)  # rounds read per bucket
    predicted: dict[int, float] = field(default_factory=dict)  # sum of 1 + S per bucket (uncalibrated)
    expected: dict[int, float] = field(default_factory=dict)  # sum of the E the choices expected
    observed: dict[int, float] = field(default_factory=dict)  # sum of committed tokens per bucket
    requests: dict[int, int] = field(default_factory=dict)  # (request, round) pairs per bucket
    last_pick: _Choice | None = None  # the choice of the round last read
    # rounds read between refreshes of the estimates the choice weighs (the fit, the long run, the
    # levels, the cost table): 1 refreshes after every round; more saves the host their recomputation
    # on the rounds between (module docstring, "The host's time"); a bucket's first pairs, draft or
    # median refresh at once
    refresh_rounds: int = 1
    # observe() leaves a due refresh to refresh_when_due() (module docstring, "Deferred refreshes")
    defer_refresh: bool = False
    _unrefreshed: int = field(init=False, default=0)  # rounds read since the last refresh
    _standing_kept: _Standing | None = field(init=False, default=None)  # _standing(), while it stands

    def __post_init__(self) -> None:
        self.calibration = Calibration(self.buckets)
        self.calibration.held = self.refresh_rounds > 1
        self.paces = Paces()
        self._drafting = [j for j, k in enumerate(self.buckets) if k > 0]  # the buckets that draft
        self._trees = np.array([k > 0 for k in self.buckets])  # the same, as a mask
        chain = chain_bucket(self.buckets)
        self._chain = None if chain is None else self.buckets.index(chain)
        # the two masks _candidate_mask() returns (read-only: shared by every pick): every bucket, and
        # every bucket but the chain
        self._every = np.ones(len(self.buckets), dtype=bool)
        self._without_chain = self._every.copy()
        if self._chain is not None:
            self._without_chain[self._chain] = False
        self._every.flags.writeable = self._without_chain.flags.writeable = False
        self._candidates = self._every  # _candidate_mask(), set by each pick
        # per bucket index: the indices of the smaller trees whose counts its round tells
        self._nested = [np.array([self.buckets.index(k) for k in smaller_trees(self.buckets, n, chain)],
                                 dtype=np.int64) for n in self.buckets]  # fmt: skip
        self._nested_down = [columns[:, None] for columns in self._nested]  # the same, as [columns, 1]
        self.new_call()

    def new_call(self, copies: Sequence[int] | None = None, stage_timed: bool = False) -> None:
        """A Runner's next call: its requests, the rounds left unread and its report start afresh; the
        costs and the calibration carry over. copies: per request row, the first row of its greedy
        copies (same prompt, same limit: the same tokens every round), or None (module docstring).
        stage_timed: the call times its stages (engine.stats.StageTimer), which reads two events per
        stage back each round and so slows every round: such a call's rounds are priced in cost tables
        of their own, kept apart from untimed calls' (a bucket seldom picked in untimed calls would
        otherwise keep a stage-timed round's price); the other mode's table prices what this one has
        not measured yet, shifted (CostTable.estimate), so that a first untimed call does not try every
        bucket again."""
        for mode in (stage_timed, not stage_timed):
            if mode not in self._cost_tables:
                self._cost_tables[mode] = (CostTable(self.buckets), CostTable((0,)))
        self.costs, self.step_costs = self._cost_tables[stage_timed]
        other_costs, other_steps = self._cost_tables[not stage_timed]
        for table, other in ((self.costs, other_costs), (self.step_costs, other_steps)):
            table.fallback = other
            table.held = self.refresh_rounds > 1
            table.forget_estimates()
        self.copies = None if copies is None else np.asarray(copies, dtype=np.int64)
        if self.copies is not None and (self.copies == np.arange(self.copies.size)).all():
            self.copies = None  # every request its own first row: none repeats another
        self.sums = np.zeros((0, len(self.buckets)))
        self.age = np.zeros(0)
        self.paces.new_call()
        self.call_test = CallTest(self.depth)
        self.pending.clear()
        self.streak, self.call_steps, self.stepping, self.last_read = 0, 0, False, None
        for tally in (self.chosen, self.predicted, self.expected, self.observed, self.requests):
            tally.clear()

    def _rows(self, count: int) -> None:
        """Room for `count` request rows (a new row has no S read yet); the paces' rows grow with
        these (both start empty with each call)."""
        more = count - self.sums.shape[0]
        if more > 0:
            self.sums = np.concatenate([self.sums, np.full((more, len(self.buckets)), np.nan)])
            self.age = np.concatenate([self.age, np.zeros(more)])
            self.paces.rows(count)

    def _seen(self, rows: np.ndarray | slice) -> np.ndarray:
        """The S at every bucket the choice sees for the request rows (indices, or a slice of them):
        each one's last draft's, pulled towards the bucket's level by STALE_DECAY per round picked since
        it was read (the level alone before its first draft read; 0 where neither is known). Drafting
        every round, each pick follows a read: the age stays 0. (S is finite: NaN in `seen` comes only
        from an S not read.)"""
        own = self.sums[rows]
        standing = self._standing()
        levels, known, unknown = standing.levels, standing.known, standing.unknown
        seen = own - levels  # levels + keep (own - levels), in place
        seen *= (STALE_DECAY ** self.age[rows])[:, None]
        seen += levels
        if unknown is not None:  # a bucket no draft built yet: the request's own S
            np.copyto(seen, own, where=unknown)
        np.copyto(seen, known, where=np.isnan(own))  # no S of its own: the level, else 0
        return seen

    def _standing(self) -> _Standing:
        """What the choice derives from the estimates it weighs and the candidates (_Standing), kept
        until one of them changes (a refresh, a bucket's first of its kind, the chain ruled in or out):
        the picks between read it instead of deriving it again (module docstring, "The host's time")."""
        key = (self.calibration.version, id(self.costs), self.costs.version, id(self._candidates))
        kept = self._standing_kept
        if kept is None or kept.key != key:
            kept = self._standing_kept = self._standing_afresh(key)
        return kept

    def _standing_afresh(self, key: tuple) -> _Standing:
        levels, unknown = self.calibration.levels(), self.calibration.unknown_levels()
        _, costs, _ = self.costs.estimates()
        candidates = self._candidates.tolist()
        allowed = {}
        for must_draft in (False, True):
            indices = [j for j in (self._drafting if must_draft else range(len(costs))) if candidates[j]]
            allowed[must_draft] = indices, [costs[j] for j in indices]
        step = self.buckets.index(0) if 0 in self.buckets else None
        return _Standing(
            key,
            levels,
            levels if unknown is None else np.where(unknown, 0.0, levels),
            unknown,
            unmeasured=any(c <= 0 for c, ok in zip(costs, candidates) if ok),
            priced=step is not None and costs[step] > 0 and any(costs[j] > 0 for j in self._drafting),
            allowed=allowed,
        )

    def pick(self, active: Sequence[bool], must_draft: bool, remaining: Sequence[int] | None = None) -> int:
        """The bucket of the next round enqueued: the most expected tokens per second over the running
        requests; a speculative one when the drafter must run (a call's first round, a full context).
        remaining: the tokens each request row has left in a static call (None: a batch whose finished
        rows are refilled): then an autoregressive step whenever steps alone would end the call
        soonest (engine.budget_call). When they do by a decisive margin, the call is given to steps
        (`stepping`): every later round of it is a step, the drafter never runs again in it (a draft
        the drafter must make, such as a call's first, is skipped), so its steps need not feed the
        drafter's context and cost what plain autoregressive decoding's do."""
        if self.stepping:  # a call given to steps: nothing to weigh until it ends
            return self._step_of_stepping_call(active)
        must_draft = must_draft or self.streak >= self.depth
        self._candidates = self._candidate_mask()
        self._rows(len(active))
        rows = np.asarray(active, dtype=bool).nonzero()[0]  # np.flatnonzero without its wrappers
        index = slice(0, rows.size) if rows.size == len(active) else rows  # every row running: in place
        seen = self._seen(index)
        per_row = self.calibration.expected(seen)  # [rows, buckets]
        totals, why, rate, costs = per_row.sum(axis=0), "call", None, None
        if remaining is not None and self._steps_end_soonest(rows, remaining, must_draft):
            j = self.buckets.index(0)
            if (
                not self.stepping
                and self.call_steps >= PROBE_STEPS
                and (self._one_request(rows) or self._unbuilt() is not None)
            ):
                j, why = self._probe(), "probe"
        else:
            expected = totals.tolist()
            chain = self._chain
            if chain is not None:  # the chain at its lower bound (module docstring)
                lower = per_row[:, chain] - self.calibration.bonus()[chain]
                expected[chain] = float(np.maximum(1.0, lower).sum())
            _, costs, _ = self.costs.estimates()
            allowed, allowed_costs = self._standing().allowed[must_draft]
            rate = self._steady_rate(rows.size)
            j = allowed[choose([expected[j] for j in allowed], allowed_costs, rate)]
            why = "untried" if costs[j] <= 0 else "rule"
            if self.buckets[j] == 0:
                step, j = j, self._explore(costs, j)
                why = "explore" if j != step else why
        self.pending.append(_Choice(rows, seen, per_row[:, j], why, totals, rate, costs))
        self.age[index] += 1
        step = self.buckets[j] == 0
        self.streak = self.streak + 1 if step else 0
        self.call_steps = self.call_steps + 1 if step and why == "call" else 0
        return self.buckets[j]

    def _step_of_stepping_call(self, active: Sequence[bool]) -> int:
        """pick() in a call given to steps: a step, with none of the choice's per-round work (the
        host's time per round is what a call of steps pays beside the device's steps)."""
        rows = np.asarray(active, dtype=bool).nonzero()[0]  # np.flatnonzero without its wrappers
        seen = np.zeros((rows.size, len(self.buckets)))
        self.pending.append(_Choice(rows, seen, np.ones(rows.size), "stepping"))
        self.streak += 1
        return 0

    def _explore(self, costs: Sequence[float], step: int) -> int:
        """The rule picked a step (index `step`). Where steps are also the steady choice (the bucket of
        most tokens per second used every round, at the buckets' long-run acceptance), the steady
        choice with each tree's acceptance raised to its upper bound (Calibration.optimistic_long_run;
        module docstring, "Exploring against steps"), which is a tree or the step; otherwise the step
        (a round whose own draft promises little). Ties go to the first bucket, the step."""
        if self._unmeasured():
            return step
        if self._steady_choice(self._long_run_as_chosen(), costs) != step:
            return step  # a tree is the steady choice: this round's step is the draft's call
        upper, _ = self.calibration.optimistic_long_run()
        return self._steady_choice(upper, costs)

    def _steady_choice(self, ybar: np.ndarray, costs: Sequence[float], trees_only: bool = False) -> int:
        """The index of the candidate bucket (a tree, with trees_only) of most tokens per second used
        every round, each committing 1 + ybar tokens (costs: measured, > 0); ties go to the first."""
        allowed = self._candidates & self._trees if trees_only else self._candidates
        return int(np.argmax((1.0 + ybar) / np.where(allowed, np.asarray(costs), np.inf)))

    def _one_request(self, rows: np.ndarray) -> bool:
        """Whether the running request rows are one request, or greedy copies of one (new_call's
        copies): a call whose end is that request's, with no tail of others behind it."""
        return self._distinct(rows).size == 1

    def _distinct(self, rows: np.ndarray) -> np.ndarray:
        """The request rows with each group of greedy copies (new_call's copies) counted once, by its
        first row, in order."""
        if self.copies is None or rows.size <= 1:
            return rows
        _, first = np.unique(self.copies[rows], return_index=True)
        return rows[np.sort(first)]

    def _probe(self) -> int:
        """A tree in place of the static call's test's step after PROBE_STEPS of them in a row (module
        docstring, "Probing the test's steps"): the largest tree never built, if any ("Trees never
        built"), else the steady choice among the trees at their long-run acceptance
        (Calibration.long_run). Every candidate is measured here (the test answered)."""
        unbuilt = self._unbuilt()
        if unbuilt is not None:
            return unbuilt
        _, costs, _ = self.costs.estimates()
        ybar, _ = self.calibration.long_run()
        return self._steady_choice(ybar, costs, trees_only=True)

    def _unmeasured(self) -> bool:
        """Whether a bucket the choice may take is not measured yet (CostTable.estimate 0): the choice
        then explores, and neither the steady rate nor the static call's test is known."""
        return self._standing().unmeasured

    def _unbuilt(self) -> int | None:
        """The largest candidate tree bucket no draft read has built yet, or None: a call is not given
        to steps while there is one, and the probe drafts it (module docstring, "Trees never built")."""
        unknown = self.calibration.unknown_levels()
        if unknown is None:
            return None
        never = np.flatnonzero(unknown & self._trees & self._candidates)
        return int(never[-1]) if never.size else None

    def _candidate_mask(self) -> np.ndarray:
        """Per bucket, whether the choice may take it: every bucket, but the chain's only while its own
        calibration ratio is at least CHAIN_MIN_RATIO (module docstring). Read-only."""
        if self._chain is None:
            return self._every
        ratio = self.calibration.own_ratio(self._chain)
        return self._every if ratio is None or ratio >= CHAIN_MIN_RATIO else self._without_chain

    def _steady_rate(self, requests: int) -> float:
        """lambda of the choice (module docstring): the batch's tokens per second with the best bucket
        every round, its `requests` each committing the bucket's long-run tokens (Calibration.long_run:
        E at the bucket's level of S); 0 while a bucket is unmeasured (costs 0: the choice explores).
        Kept (_standing) per count of requests."""
        rates = self._standing().rates
        if requests not in rates:
            rates[requests] = self._steady_rate_afresh(requests)
        return rates[requests]

    def _steady_rate_afresh(self, requests: int) -> float:
        _, costs, _ = self.costs.estimates()
        if requests == 0 or self._unmeasured():
            return 0.0
        ybar = self._long_run_as_chosen().tolist()
        rates = [(1.0 + y) * requests for y, ok in zip(ybar, self._candidates.tolist()) if ok]
        return steady_rate(rates, [c for c, ok in zip(costs, self._candidates.tolist()) if ok])

    def _long_run_as_chosen(self) -> np.ndarray:
        """The long-run accepted drafted tokens per bucket (Calibration.long_run) as the per-round
        choice weighs them: the chain's at its lower bound (module docstring), so that an estimate the
        choice does not act on cannot set the steady rate or the steady choice. Weighing the chain at
        its point estimate there while the choice saw it at its lower bound made every round's best
        value a step: an untested chain's promise raised the rate that each tree's round had to pay."""
        ybar, _ = self.calibration.long_run()
        if self._chain is None:
            return ybar
        ybar = ybar.copy()
        ybar[self._chain] = max(0.0, ybar[self._chain] - self.calibration.bonus()[self._chain])
        return ybar

    def _steps_end_soonest(self, rows: np.ndarray, remaining: Sequence[int], must_draft: bool) -> bool:
        """The static call's test (engine.budget_call.CallTest) for the running request rows, once the
        step's cost and a tree's (CostTable.estimate) are measured, over the buckets measured: the
        tokens each has left less what the rounds picked and not read yet are expected to commit. A
        decisive answer for steps gives the call to steps (`stepping`), and so does a close one that
        has stepped SETTLED_STEPS rounds in a row (module docstring, "Settled steps"); while the
        drafter must run, or while a bucket is not measured yet (the rule would try it), only a
        decisive answer steps."""
        if 0 not in self.buckets or rows.size == 0 or not self._standing().priced:
            return False
        costs, _, _ = self.costs.estimates()
        partial = self._unmeasured()
        most = float(np.asarray(remaining)[rows].max())
        steps = self.call_test.kept_answer(most)
        decisive = steps is not None  # an answer is kept only when it was decisive
        if steps is None:
            steps = self._call_answer(rows, remaining, costs, most)
            decisive = self.call_test.kept > 0
        step = steps and not must_draft and not partial  # a step this round on a close answer
        settled = step and self.call_steps + 1 >= SETTLED_STEPS
        self.stepping = steps and (decisive or settled) and self._unbuilt() is None
        return self.stepping or step

    def _call_answer(
        self, rows: np.ndarray, remaining: Sequence[int], costs: np.ndarray, most: float
    ) -> bool:
        """The static call's test computed afresh (CallTest.decide) for the running request rows, each
        group of greedy copies counted once (module docstring)."""
        left = np.asarray(remaining, dtype=np.float64).copy()
        for choice in self.pending:
            left[choice.rows] -= choice.expected
        rows = self._distinct(rows)
        pace, pace_variance = self.paces.estimate(rows)
        left = np.maximum(left[rows], 1.0)
        ybar, variance = self.calibration.long_run()
        costs, switch = self._call_costs(costs)
        seconds = self._call_seconds(costs, switch, left, ybar, variance, pace, pace_variance)
        steps = self.call_test.decide(seconds, self.buckets.index(0), most)
        if steps and self.call_test.kept:  # decisive: the call is given to steps only if the trees'
            ybar, variance = self.calibration.optimistic_long_run()  # upper bounds agree (module doc)
            seconds = self._call_seconds(costs, switch, left, ybar, variance, pace, pace_variance)
            if not self.call_test.decisive_steps(seconds, self.buckets.index(0)):
                self.call_test.kept = 0
        return steps

    def _call_costs(self, costs: np.ndarray) -> tuple[np.ndarray, float]:
        """(costs, switch): what the static call's test prices a call at. A step costs what steps in a
        row cost where that is measured and below STEADY_STEP_MARGIN of the table's (a call given to
        steps takes nothing but steps, while a step read between speculative rounds also carries the
        host's work for them), and then a call of steps that starts after a tree pays the table's
        price for its first step: switch, the difference, added once; otherwise the table's, switch 0."""
        steady = self.step_costs.estimate(0)
        j = self.buckets.index(0)
        if steady <= 0 or steady >= STEADY_STEP_MARGIN * costs[j]:
            return costs, 0.0
        switch = 0.0 if self.streak > 0 else float(costs[j] - steady)  # streak: the last pick a step
        costs = costs.copy()
        costs[j] = steady
        return costs, switch

    def _call_seconds(
        self,
        costs: np.ndarray,
        switch: float,
        left: np.ndarray,
        ybar: np.ndarray,
        variance: np.ndarray,
        pace: np.ndarray,
        pace_var: np.ndarray,
    ) -> np.ndarray:
        """steady_call_seconds with `switch` added to the steps' (see _call_costs), inf for a bucket
        the test does not weigh (the chain ruled out, a bucket not measured yet)."""
        seconds = steady_call_seconds(costs, left, ybar, variance, pace, pace_var)
        seconds[self.buckets.index(0)] += switch
        return np.where(self._candidates & (costs > 0), seconds, np.inf)

    def observe(self, bucket: int, seconds: float | None, rows: Sequence[int], counts: Sequence[int],
                sums: np.ndarray | Sequence[Sequence[float]] | None,
                would: np.ndarray | Sequence[Sequence[float]] | None = None) -> None:  # fmt: skip
        """One round read (the oldest picked): its bucket, its measured seconds (None: not
        representative, e.g. eager), the request rows that were running, their committed counts, the
        round's sums per request row ([rows of the batch, buckets]; None for an autoregressive round)
        and what each smaller tree would have committed on it (would_commit, same shape; None: not
        told). Each smaller tree's counts are fitted as if it had run: every bucket is then judged on
        the same rounds as the larger ones, not only on the rounds it was chosen for (which the
        choice picks by how the draft looks, so that a bucket picked for hard rounds would look worse
        than it is)."""
        choice = self.pending.popleft() if self.pending else None
        self.last_pick = choice
        if seconds is not None:
            self.costs.observe(bucket, seconds)
            if bucket == 0 and self.last_read == 0:
                self.step_costs.observe(0, seconds)
        self.last_read = bucket
        self.chosen[bucket] = self.chosen.get(bucket, 0) + 1
        self._unrefreshed += 1
        if sums is None:
            self._refresh_unless_deferred()
            return
        j, cal = self.buckets.index(bucket), self.calibration
        rows = np.asarray(rows, dtype=np.int64)
        row_list = rows.tolist()
        # the first rows in order (every request running): read and written as a slice, in place
        index = slice(0, rows.size) if row_list == list(range(rows.size)) else rows
        sums = np.asarray(sums, dtype=np.float64)
        # [rows, buckets], NaN past the bucket built (a copy: the calibration keeps it; a slice's copies
        # faster than indexing by rows)
        own = sums[rows] if index is rows else sums[index].copy()
        committed = np.asarray(counts)  # (integers: as floats, the same)
        accepted = committed[index] - 1.0
        total = total_of(accepted)
        if choice is not None:
            got, ran = accepted, index  # the rows the choice saw ran this round: this round's acceptance
            if choice.rows.tolist() != row_list:
                choice = self._still_running(choice, rows)
                got, ran = committed[choice.rows] - 1.0, choice.rows
            ybar, variance = cal.long_run_values()  # before this round is added
            before = cal.expected_coefficients() if would is not None else None  # kept from the last pick
            self.paces.observe(ran, got, ybar[j], variance[j])
            cal.observe_choices(j, choice.seen[:, j], got, choice.expected)
            if would is not None:
                self._observe_smaller(j, choice, np.asarray(would, dtype=np.float64), sums, before)
            expected = total_of(choice.expected)
        else:
            expected = float(len(rows))
        cal.observe_drafts(own)
        predicted = own[:, j]
        cal.observe_totals(j, total, total_of(predicted))
        self.expected[bucket] = self.expected.get(bucket, 0.0) + expected
        self.predicted[bucket] = self.predicted.get(bucket, 0.0) + total_of(1.0 + predicted)
        self.observed[bucket] = self.observed.get(bucket, 0.0) + (total + len(rows))
        self.requests[bucket] = self.requests.get(bucket, 0) + len(rows)
        self._rows(max(row_list) + 1 if row_list else 0)
        self.sums[index], self.age[index] = own, 0
        self._refresh_unless_deferred()

    def _refresh_unless_deferred(self) -> None:
        if not self.defer_refresh:
            self._refresh_when_due()

    def refresh_when_due(self, active: Sequence[bool] | None = None) -> bool:
        """With defer_refresh, where the host has time to spare (module docstring, "Deferred
        refreshes"): the refresh observe() left due, if any, and then what the next pick derives from
        the refreshed estimates (the standing, and the steady rate for the `active` request rows, as
        pick() takes them). Returns whether it refreshed."""
        if not self._refresh_when_due():
            return False
        self._candidates = self._candidate_mask()
        self._standing()
        running = 0 if active is None else int(np.count_nonzero(active))
        if running:
            self._steady_rate(running)
        return True

    def _refresh_when_due(self) -> bool:
        """Every refresh_rounds rounds read, the estimates the choice weighs recomputed from all of them."""
        if self._unrefreshed < self.refresh_rounds:
            return False
        self._unrefreshed = 0
        self.calibration.refresh()
        self.costs.refresh()
        self.step_costs.refresh()
        return True

    def _observe_smaller(self, j: int, choice: _Choice, would: np.ndarray, own: np.ndarray,
                         coefficients: Pair) -> None:  # fmt: skip
        """The counts the smaller trees would have committed on the round read (bucket index j; would
        and own [rows of the batch, buckets]), fitted as rounds of theirs (Calibration.observe_nested):
        on the S their choice saw, against their own S of this draft and the fit before the round."""
        columns = self._nested[j]
        if columns.size:
            rows, seen = choice.rows, choice.seen[:, columns]
            down = self._nested_down[j]
            accepted = self._rows_by_columns(would, rows, down) - 1.0
            own = self._rows_by_columns(own, rows, down)
            self.calibration.observe_nested(columns, seen, accepted, own, coefficients)

    @staticmethod
    def _rows_by_columns(values: np.ndarray, rows: np.ndarray, down: np.ndarray) -> np.ndarray:
        """values[rows][:, columns] in one indexing (down: columns[:, None]), laid out as that gives
        it (column-major): the calibration's sums over it then add in the same order."""
        return values.T[down, rows].T

    @staticmethod
    def _still_running(choice: _Choice, rows: np.ndarray) -> _Choice:
        """The part of a choice (in its order) whose rows ran in the round read (`rows`: that round's
        request rows)."""
        running = np.zeros(max(int(choice.rows.max(initial=-1)), int(rows.max(initial=-1))) + 1, bool)
        running[rows] = True
        same = running[choice.rows]
        return _Choice(choice.rows[same], choice.seen[same], choice.expected[same], choice.why,
                       choice.batch_expected)  # fmt: skip

    def report(self) -> dict[int, dict[str, float]]:
        """Per bucket, over this call: rounds read, mean tokens per request predicted (uncalibrated:
        1 + S of the round's own draft; expected: the E its choice expected, from earlier rounds),
        observed, and the median round seconds; an autoregressive round commits exactly one token."""
        out = {}
        for k in self.buckets:
            n = self.requests.get(k, 0)
            mean = {key: (d.get(k, 0.0) / n if n else float("nan"))
                    for key, d in (("predicted", self.predicted), ("expected", self.expected),
                                   ("observed", self.observed))}  # fmt: skip
            if k == 0:
                mean = dict.fromkeys(mean, 1.0)
            seconds = self.costs.measured(k)
            out[k] = {
                "rounds": self.chosen.get(k, 0),
                **mean,
                "seconds": float("nan") if seconds is None else seconds,
            }
        return out
