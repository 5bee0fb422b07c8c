"""The cost-aware tree budget ("auto"): each round the engine verifies the first n nodes of the draft
tree for the n among a few captured buckets (0 included: an autoregressive step, no drafter forward)
that maximizes the expected committed tokens per second of the whole batch.

The estimator. A best-first tree's nodes come out in decreasing draft path probability. Under sampled
DDTree acceptance with a drafter whose distribution is the target's, node i is on the accepted path
with probability p_i, its path probability (the product of the target's probabilities of its tokens),
so a tree of the first n nodes commits E(n) = 1 + sum_{i < n} p_i tokens in expectation (the bonus
token included), exactly. A real drafter is miscalibrated; the engine corrects the sum per bucket by
the ratio of what was accepted to what was predicted in the rounds that verified that bucket:

    E_b(n) = 1 + r_n * S_b(n),   S_b(n) = sum_{i < n} p_{b,i},   r_n = sum(accepted - 1) / sum(S)

over the rounds of bucket n (r_n = 1 before any; a bucket never tried borrows its nearest tried
bucket's ratio). The path probabilities come from the draft's own log-softmax along each node's
ancestors (`path_probabilities`); the sums at the bucket boundaries ride on the round's one
device-to-host copy, so the choice for round k + 1 uses the figures of the last round read.

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
class Calibration:
    """Per bucket, the accepted drafted tokens and the predicted sums S of the rounds that verified it
    (see the module docstring): ratio(n) = accepted / predicted."""

    buckets: tuple[int, ...]
    accepted: dict[int, float] = field(default_factory=dict)
    predicted: dict[int, float] = field(default_factory=dict)

    def observe(self, bucket: int, accepted: Sequence[int], predicted: Sequence[float]) -> None:
        """One round of `bucket`: per running request, the drafted tokens it accepted (committed - 1)
        and the sum S the round's draft predicted for it."""
        self.accepted[bucket] = self.accepted.get(bucket, 0.0) + float(sum(accepted))
        self.predicted[bucket] = self.predicted.get(bucket, 0.0) + float(sum(predicted))

    def ratio(self, bucket: int) -> float:
        """r_n: accepted / predicted of this bucket, else of the nearest bucket with a prediction, else
        1 (a calibrated drafter)."""
        tried = [k for k in self.buckets if self.predicted.get(k, 0.0) > 0]
        if not tried:
            return 1.0
        k = min(tried, key=lambda k: (abs(k - bucket), k))
        return self.accepted.get(k, 0.0) / self.predicted[k]


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


def expected_tokens(
    sums: Sequence[Sequence[float]], buckets: Sequence[int], calibration: Calibration
) -> list[float]:
    """Per bucket, the expected committed tokens of the batch: sum over the running requests of
    1 + r_n * S_b(n) (sums: per running request, its S at each bucket)."""
    return [sum(1.0 + calibration.ratio(k) * row[j] for row in sums) for j, k in enumerate(buckets)]


def choose(expected: Sequence[float], costs: Sequence[float]) -> int:
    """The index of the bucket with the most expected tokens per second; a bucket of cost 0 (never
    measured) first, the smallest such (exploration); ties: the smaller."""
    for j, c in enumerate(costs):
        if c <= 0:
            return j
    return max(range(len(costs)), key=lambda j: (expected[j] / costs[j], -j))


@dataclass
class BudgetPolicy:
    """The host side of the auto budget for one Runner (its cost table and calibration carry over to
    its later calls): picks each round's bucket from the last figures read, and learns from each round
    read. `depth`: L + 1, the most autoregressive rounds in a row (the drafter's context holds the rows
    of one speculative round plus L + 1 more)."""

    buckets: tuple[int, ...]
    depth: int
    calibration: Calibration = field(init=False)
    costs: CostTable = field(init=False)
    sums: dict[int, list[float]] = field(default_factory=dict)  # request row -> S at each bucket
    streak: int = 0  # autoregressive rounds enqueued since the last draft
    chosen: dict[int, int] = field(default_factory=dict)  # rounds read per bucket
    predicted: dict[int, float] = field(default_factory=dict)  # sum of 1 + S per bucket (uncalibrated)
    calibrated: dict[int, float] = field(default_factory=dict)  # sum of 1 + r S, r as it was then
    observed: dict[int, float] = field(default_factory=dict)  # sum of committed tokens per bucket
    requests: dict[int, int] = field(default_factory=dict)  # (request, round) pairs per bucket

    def __post_init__(self) -> None:
        self.calibration = Calibration(self.buckets)
        self.costs = CostTable(self.buckets)

    def new_call(self) -> None:
        """A Runner's next call: its requests and its report start afresh; the costs and the
        calibration carry over."""
        self.sums.clear()
        self.streak = 0
        for tally in (self.chosen, self.predicted, self.calibrated, self.observed, self.requests):
            tally.clear()

    def pick(self, active: Sequence[bool], must_draft: bool) -> int:
        """The bucket of the next round enqueued: the most expected tokens per second over the running
        requests; a speculative one when the drafter must run (a call's first round, a full context)."""
        must_draft = must_draft or self.streak >= self.depth
        zeros = [0.0] * len(self.buckets)
        rows = [self.sums.get(r, zeros) for r, on in enumerate(active) if on]
        expected = expected_tokens(rows, self.buckets, self.calibration)
        allowed = [j for j, k in enumerate(self.buckets) if k > 0 or not must_draft]
        costs = [self.costs.estimate(self.buckets[j]) for j in allowed]
        bucket = self.buckets[allowed[choose([expected[j] for j in allowed], costs)]]
        self.streak = self.streak + 1 if bucket == 0 else 0
        return bucket

    def observe(self, bucket: int, seconds: float | None, rows: Sequence[int], counts: Sequence[int],
                sums: Sequence[Sequence[float]] | None) -> None:  # fmt: skip
        """One round read: its bucket, its measured seconds (None: not representative, e.g. eager),
        the request rows that were running, their committed counts, and the round's sums per request
        row (None for an autoregressive round)."""
        if seconds is not None:
            self.costs.observe(bucket, seconds)
        self.chosen[bucket] = self.chosen.get(bucket, 0) + 1
        if sums is None:
            return
        j = self.buckets.index(bucket)
        accepted = [counts[r] - 1 for r in rows]
        predicted = [sums[r][j] for r in rows]
        ratio = self.calibration.ratio(bucket)  # what the choice assumed
        self.calibrated[bucket] = self.calibrated.get(bucket, 0.0) + sum(1.0 + ratio * p for p in predicted)
        self.calibration.observe(bucket, accepted, predicted)
        self.predicted[bucket] = self.predicted.get(bucket, 0.0) + sum(1.0 + p for p in predicted)
        self.observed[bucket] = self.observed.get(bucket, 0.0) + float(sum(counts[r] for r in rows))
        self.requests[bucket] = self.requests.get(bucket, 0) + len(rows)
        for r in rows:
            self.sums[r] = list(sums[r])

    def report(self) -> dict[int, dict[str, float]]:
        """Per bucket, over this call: rounds read, mean tokens per request predicted (uncalibrated
        1 + S, and 1 + r S with r as it stood when the round was read, before learning from it),
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
