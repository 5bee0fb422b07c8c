"""The cost-aware tree budget ("auto"): each round the engine verifies the first n nodes of the draft
tree for the n among a few captured buckets (0 included: an autoregressive step, no drafter forward)
that maximizes the expected committed tokens per second of the whole batch.

The path probabilities. A best-first tree's nodes come out in decreasing draft path probability.
Under sampled DDTree acceptance with a drafter whose distribution is the target's, node i is on the
accepted path with probability p_i, its path probability, so a tree of the first n nodes commits
E(n) = 1 + S(n), S(n) = sum_{i < n} p_i, tokens in expectation (the bonus token included), exactly.
The draft computes p from its own log-softmax along each node's ancestors (`path_probabilities`);
the sums at the bucket boundaries ride on the round's one device-to-host copy.

The estimator. The choice of round k + 1 is made before round k is read (the rounds are pipelined),
so it sees each request's S from an earlier round, x = S_b(n) of its last draft read; when `a` rounds
were picked since that read (autoregressive ones: no new S), x is pulled towards the bucket's level
(the mean S of every draft read) by a factor STALE_DECAY^a. Per bucket, over the (request, round)
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
last rounds of that bucket, CUDA events around the round, or the wall clock on the CPU). A bucket not
measured yet costs 0, so that each gets tried once, the smallest first.

The choice: argmax over buckets of sum_b E_b(n) / c(n), over the requests still running.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

AUTO_BUCKETS = (0, 4, 8, 16, 32, 64)  # nodes verified per round besides the root
COST_WINDOW = 16  # rounds per bucket whose median is its cost
PRIOR_PAIRS = 4.0  # pseudo-pairs of the calibrated prediction in a bucket's mean acceptance
SLOPE_PAIRS = 16.0  # pairs at which a bucket's fitted slope counts half
STALE_DECAY = 0.5  # per autoregressive round, how much of a request's last S survives


def path_probabilities(draft_logits: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                       visibility: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The draft path probability of every tree node: draft_logits [B, L, V]; tokens / depths [B, n]
    (node i + 1's token and 1-based depth, -1 where unused); visibility [B, n + 1, n + 1] bool (node i
    sees its ancestors and itself; row 0 the root) -> [B, n] float32, 0 for unused nodes. Device ops
    only (capturable): log-softmax normalizers per depth, each node's own log-probability gathered,
    summed over its ancestors through the visibility mask."""
    b, n = tokens.shape
    if n == 0:
        return torch.zeros(b, 0, dtype=torch.float32, device=tokens.device)
    logits = draft_logits.float()
    norm = torch.logsumexp(logits, dim=-1)  # [B, L]
    used = tokens >= 0
    depth = (depths - 1).clamp(min=0)
    flat = depth * logits.shape[-1] + tokens.clamp(min=0)  # [B, n] index into [L * V]
    node_lp = logits.reshape(b, -1).gather(1, flat) - norm.gather(1, depth)  # [B, n]
    node_lp = torch.where(used, node_lp, 0.0)
    ancestors = visibility[:, 1:, 1:].to(torch.float32)  # [B, n, n]: node i sees node j (root dropped)
    path_lp = torch.bmm(ancestors, node_lp[..., None]).squeeze(-1)  # [B, n]
    return torch.where(used, path_lp.exp(), 0.0)


def bucket_sums(probs: torch.Tensor, buckets: Sequence[int]) -> torch.Tensor:
    """probs [B, n] (nodes in best-first order) -> [B, len(buckets)] float32: the sum of the first
    min(k, n) probabilities for each bucket k. Device ops only (capturable: no index tensor copied
    from the host)."""
    b, n = probs.shape
    cum = torch.cat([probs.new_zeros(b, 1), probs.float().cumsum(dim=1)], dim=1)  # [B, n + 1]
    return torch.stack([cum[:, min(k, n)] for k in buckets], dim=1)


@dataclass
class _Fit:
    """Running sums of (x, y) pairs: x the S a choice saw, y the drafted tokens then accepted."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx, self.sy = self.sx + x, self.sy + y
        self.sxx, self.sxy = self.sxx + x * x, self.sxy + x * y

    def slope(self) -> float:
        """The least-squares slope of y on x, >= 0, shrunk by n / (n + SLOPE_PAIRS); 0 without spread."""
        var = self.sxx - self.sx * self.sx / self.n
        if var <= 1e-12 * max(1.0, self.sxx):
            return 0.0
        cov = self.sxy - self.sx * self.sy / self.n
        return max(0.0, cov / var) * self.n / (self.n + SLOPE_PAIRS)


@dataclass
class Calibration:
    """What the drafter's path probabilities are worth, learnt from the rounds read (see the module
    docstring): per bucket, the accepted drafted tokens against the round's own S (the ratio r_n), the
    level of S over every draft read, and the fit of the accepted tokens on the S the choice saw."""

    buckets: tuple[int, ...]
    accepted: dict[int, float] = field(default_factory=dict)
    predicted: dict[int, float] = field(default_factory=dict)
    fits: dict[int, _Fit] = field(default_factory=dict)
    drafts: float = 0.0  # (request, round) pairs of every draft read
    level_sums: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.level_sums = [0.0] * len(self.buckets)

    def observe(self, bucket: int, accepted: Sequence[int], predicted: Sequence[float]) -> None:
        """One round of `bucket`: per running request, the drafted tokens it accepted (committed - 1)
        and the sum S the round's draft predicted for it."""
        self.accepted[bucket] = self.accepted.get(bucket, 0.0) + float(sum(accepted))
        self.predicted[bucket] = self.predicted.get(bucket, 0.0) + float(sum(predicted))

    def observe_draft(self, sums: Sequence[float]) -> None:
        """One request's S at every bucket from a draft read (the bucket levels)."""
        self.drafts += 1
        self.level_sums = [a + float(v) for a, v in zip(self.level_sums, sums)]

    def observe_choice(self, bucket: int, seen: float, accepted: int) -> None:
        """One request of a round of `bucket`: the S at that bucket its choice saw, the drafted
        tokens it then accepted."""
        self.fits.setdefault(bucket, _Fit()).add(float(seen), float(accepted))

    def ratio(self, bucket: int) -> float:
        """r_n: accepted / predicted of this bucket, else of the nearest bucket with a prediction, else
        1 (a calibrated drafter)."""
        tried = [k for k in self.buckets if self.predicted.get(k, 0.0) > 0]
        if not tried:
            return 1.0
        k = min(tried, key=lambda k: (abs(k - bucket), k))
        return self.accepted.get(k, 0.0) / self.predicted[k]

    def level(self, j: int) -> float | None:
        """The mean S at bucket index j over every draft read (None before any)."""
        return self.level_sums[j] / self.drafts if self.drafts else None

    def expected(self, j: int, seen: float) -> float:
        """E(n) of one request for bucket index j, given the S its choice sees (module docstring)."""
        bucket = self.buckets[j]
        if bucket == 0:
            return 1.0
        r, fit = self.ratio(bucket), self.fits.get(bucket)
        if fit is None:
            return 1.0 + r * seen
        level = self.level(j)
        prior = r * (seen if level is None else level)
        mean_y = (fit.sy + PRIOR_PAIRS * prior) / (fit.n + PRIOR_PAIRS)
        return max(1.0, 1.0 + mean_y + fit.slope() * (seen - fit.sx / fit.n))


@dataclass
class CostTable:
    """Measured seconds per round of each bucket at one batch size: the median of the last COST_WINDOW."""

    buckets: tuple[int, ...]
    times: dict[int, deque] = field(default_factory=dict)

    def observe(self, bucket: int, seconds: float) -> None:
        self.times.setdefault(bucket, deque(maxlen=COST_WINDOW)).append(float(seconds))

    def measured(self, bucket: int) -> float | None:
        t = self.times.get(bucket)
        return statistics.median(t) if t else None

    def estimate(self, bucket: int) -> float:
        """The bucket's median, or 0 for one not measured yet (so that every bucket gets tried once:
        an autoregressive step costs far less than any tree, which no neighbour tells)."""
        own = self.measured(bucket)
        return 0.0 if own is None else own


def expected_tokens(seen: Sequence[Sequence[float]], calibration: Calibration) -> list[float]:
    """Per bucket, the expected committed tokens of the batch: the sum over the running requests of
    E_b(n) (seen: per running request, the S its choice sees at each bucket)."""
    buckets = range(len(calibration.buckets))
    return [sum(calibration.expected(j, row[j]) for row in seen) for j in buckets]


def choose(expected: Sequence[float], costs: Sequence[float]) -> int:
    """The index of the bucket with the most expected tokens per second; a bucket of cost 0 (never
    measured) first, the smallest such (exploration); ties: the smaller."""
    for j, c in enumerate(costs):
        if c <= 0:
            return j
    return max(range(len(costs)), key=lambda j: (expected[j] / costs[j], -j))


@dataclass
class _Choice:
    """What the choice of one enqueued round saw, per running request row: S at every bucket (aged),
    and the E it expected at the bucket chosen."""

    seen: dict[int, list[float]]
    expected: dict[int, float]


@dataclass
class BudgetPolicy:
    """The host side of the auto budget for one Runner (its cost table and calibration carry over to
    its later calls): picks each round's bucket from the last figures read, and learns from each round
    read (rounds are read in the order they were picked). `depth`: L + 1, the most autoregressive
    rounds in a row (the drafter's context holds the rows of one speculative round plus L + 1 more)."""

    buckets: tuple[int, ...]
    depth: int
    calibration: Calibration = field(init=False)
    costs: CostTable = field(init=False)
    sums: dict[int, list[float]] = field(default_factory=dict)  # request row -> S of its last draft read
    age: dict[int, int] = field(default_factory=dict)  # request row -> rounds picked since its S was read
    streak: int = 0  # autoregressive rounds enqueued since the last draft
    pending: deque = field(default_factory=deque)  # _Choice per round picked and not read yet
    chosen: dict[int, int] = field(default_factory=dict)  # rounds read per bucket
    predicted: dict[int, float] = field(default_factory=dict)  # sum of 1 + S per bucket (uncalibrated)
    calibrated: dict[int, float] = field(default_factory=dict)  # sum of the E the choices expected
    observed: dict[int, float] = field(default_factory=dict)  # sum of committed tokens per bucket
    requests: dict[int, int] = field(default_factory=dict)  # (request, round) pairs per bucket

    def __post_init__(self) -> None:
        self.calibration = Calibration(self.buckets)
        self.costs = CostTable(self.buckets)

    def new_call(self) -> None:
        """A Runner's next call: its requests, the rounds left unread and its report start afresh; the
        costs and the calibration carry over."""
        self.sums.clear()
        self.age.clear()
        self.pending.clear()
        self.streak = 0
        for tally in (self.chosen, self.predicted, self.calibrated, self.observed, self.requests):
            tally.clear()

    def _seen(self, row: int) -> list[float]:
        """The S at every bucket the choice sees for a request row: its last draft's, pulled towards
        each bucket's level by STALE_DECAY per round picked since it was read (the level alone before
        its first draft read). Drafting every round, each pick follows a read: the age stays 0."""
        cal = self.calibration
        levels = [cal.level(j) for j in range(len(self.buckets))]
        own = self.sums.get(row)
        if own is None:
            return [0.0 if v is None else v for v in levels]
        keep = STALE_DECAY ** self.age.get(row, 0)
        return [x if v is None else v + keep * (x - v) for x, v in zip(own, levels)]

    def pick(self, active: Sequence[bool], must_draft: bool) -> int:
        """The bucket of the next round enqueued: the most expected tokens per second over the running
        requests; a speculative one when the drafter must run (a call's first round, a full context)."""
        must_draft = must_draft or self.streak >= self.depth
        rows = [r for r, on in enumerate(active) if on]
        seen = {r: self._seen(r) for r in rows}
        per_row = {r: [self.calibration.expected(j, x[j]) for j in range(len(x))] for r, x in seen.items()}
        expected = [sum(e[j] for e in per_row.values()) for j in range(len(self.buckets))]
        allowed = [j for j, k in enumerate(self.buckets) if k > 0 or not must_draft]
        costs = [self.costs.estimate(self.buckets[j]) for j in allowed]
        j = allowed[choose([expected[j] for j in allowed], costs)]
        self.pending.append(_Choice(seen, {r: e[j] for r, e in per_row.items()}))
        for r in rows:
            self.age[r] = self.age.get(r, 0) + 1
        self.streak = self.streak + 1 if self.buckets[j] == 0 else 0
        return self.buckets[j]

    def observe(self, bucket: int, seconds: float | None, rows: Sequence[int], counts: Sequence[int],
                sums: Sequence[Sequence[float]] | None) -> None:  # fmt: skip
        """One round read (the oldest picked): its bucket, its measured seconds (None: not
        representative, e.g. eager), the request rows that were running, their committed counts, and
        the round's sums per request row (None for an autoregressive round)."""
        choice = self.pending.popleft() if self.pending else _Choice({}, {})
        if seconds is not None:
            self.costs.observe(bucket, seconds)
        self.chosen[bucket] = self.chosen.get(bucket, 0) + 1
        if sums is None:
            return
        j, cal = self.buckets.index(bucket), self.calibration
        for r in rows:
            if r in choice.seen:
                cal.observe_choice(bucket, choice.seen[r][j], counts[r] - 1)
            cal.observe_draft(sums[r])
        cal.observe(bucket, [counts[r] - 1 for r in rows], [sums[r][j] for r in rows])
        expected = sum(choice.expected.get(r, 1.0) for r in rows)
        self.calibrated[bucket] = self.calibrated.get(bucket, 0.0) + expected
        self.predicted[bucket] = self.predicted.get(bucket, 0.0) + sum(1.0 + sums[r][j] for r in rows)
        self.observed[bucket] = self.observed.get(bucket, 0.0) + float(sum(counts[r] for r in rows))
        self.requests[bucket] = self.requests.get(bucket, 0) + len(rows)
        for r in rows:
            self.sums[r], self.age[r] = list(sums[r]), 0

    def report(self) -> dict[int, dict[str, float]]:
        """Per bucket, over this call: rounds read, mean tokens per request predicted (uncalibrated:
        1 + S of the round's own draft; calibrated: the E its choice expected, from earlier rounds),
        observed, and the median round seconds; an autoregressive round commits exactly one token."""
        out = {}
        for k in self.buckets:
            n = self.requests.get(k, 0)
            mean = {key: (d.get(k, 0.0) / n if n else float("nan"))
                    for key, d in (("predicted", self.predicted), ("calibrated", self.calibrated),
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
