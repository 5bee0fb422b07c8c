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
measured yet costs what its neighbours suggest (see `CostTable.estimate`), so it gets tried.

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
    min(k, n) probabilities for each bucket k."""
    b, n = probs.shape
    cum = torch.cat([probs.new_zeros(b, 1), probs.float().cumsum(dim=1)], dim=1)  # [B, n + 1]
    idx = torch.tensor([min(k, n) for k in buckets], device=probs.device)
    return cum.index_select(1, idx)


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
        """The bucket's median, or for one not measured: 0 (so that it is tried) when no bucket above it
        is measured, else the cost of the nearest measured bucket above it (a smaller tree costs no
        more)."""
        own = self.measured(bucket)
        if own is not None:
            return own
        above = [k for k in self.buckets if k > bucket and self.measured(k) is not None]
        return self.measured(min(above)) if above else 0.0


def expected_tokens(
    sums: Sequence[Sequence[float]], buckets: Sequence[int], calibration: Calibration
) -> list[float]:
    """Per bucket, the expected committed tokens of the batch: sum over the running requests of
    1 + r_n * S_b(n) (sums: per running request, its S at each bucket)."""
    return [sum(1.0 + calibration.ratio(k) * row[j] for row in sums) for j, k in enumerate(buckets)]


def choose(expected: Sequence[float], costs: Sequence[float]) -> int:
    """The index of the bucket with the most expected tokens per second; a bucket of cost 0 (never
    measured, nothing measured above it) first, the smallest such (exploration); ties: the smaller."""
    for j, c in enumerate(costs):
        if c <= 0:
            return j
    return max(range(len(costs)), key=lambda j: (expected[j] / costs[j], -j))
