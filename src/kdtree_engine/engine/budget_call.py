"""The static call's test of the auto budget: whether speculating at all shortens a generate() call.

A generate() call is a static batch: it ends when its last request has its tokens, and a request that
finishes early leaves its row idle. Rounds that speculate commit more tokens per second summed over
the running requests, yet spread the requests apart (each accepts what it accepts), so the last one
finishes later than the mean; at batch 64 under sampling that tail can cost more than speculation
gains. Autoregressive steps keep every request in step: a call of m tokens left takes m steps.

So before each round the policy compares, for every bucket k, the time the call would take if every
round from here used k (`steady_call_seconds`):
- request b has m_b tokens left and commits mu_b(k) = 1 + pace_b * ybar(k) tokens per round in the
  long run (ybar: the bucket's drafted tokens accepted per round, Calibration.long_run; pace_b: how
  the request fares against the bucket means, `Paces`), so it needs m_b / mu_b(k) rounds, with
  variance m_b var(k) / mu_b(k)^3 from the rounds' own spread plus (m_b ybar(k) / mu_b(k)^2)^2 times
  the variance of its pace (what its rounds so far leave unknown of it);
- the call needs the rounds until the last request is done (`expected_last`), each c(k).
If the autoregressive steps' time (c(0) max_b m_b) is the least, the round steps autoregressively;
otherwise the per-round rule (budget.choose) picks among all buckets.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

Pair = tuple[np.ndarray, np.ndarray]
KEEP_MARGIN = 0.2  # an answer this decisive (one way ends the call this much sooner) ...
KEEP_ROUNDS = 8  # ... is kept for this many rounds


@functools.lru_cache(maxsize=1)
def _normal_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, density, cdf) of the standard normal on the grid expected_max_normal integrates over:
    computed once per process (4001 erf calls in a Python loop), so that a count first seen in a call's
    pick costs a few vectorized operations, not a round's time."""
    x = np.linspace(-10.0, 10.0, 4001)
    cdf = np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])
    return x, np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi), cdf


@functools.lru_cache(maxsize=1024)
def expected_max_normal(count: int) -> float:
    """The expected largest of `count` independent standard normals (0 for count <= 1): how many
    standard deviations the last of `count` like requests finishes behind their mean."""
    if count <= 1:
        return 0.0
    x, density, cdf = _normal_grid()
    return float((x * count * density * cdf ** (count - 1)).sum() * (x[1] - x[0]))


def expected_last(rounds: np.ndarray, variance: np.ndarray) -> np.ndarray:
    """rounds, variance [R, K]: per request and bucket the mean and variance of the rounds it still
    needs -> [K]: the expected rounds until the last of the R requests is done. For like requests that
    is their mean plus z(R) standard deviations (z: expected_max_normal); for unlike ones a soft maximum
    of the means with the same spread, tau log sum_b exp(rounds_b / tau), tau = z sd / ln R (sd: root
    mean variance), so that the requests near the slowest count by their chance of being the last."""
    count = rounds.shape[0]
    z = expected_max_normal(count)
    top = rounds.max(axis=0)
    if z == 0.0:
        return top
    mean = variance.sum(axis=0) / count  # variance.mean(axis=0), without its wrapper
    tau = np.maximum(z * np.sqrt(mean) / math.log(count), 1e-9)
    return top + tau * np.log(np.exp((rounds - top) / tau).sum(axis=0))


def steady_call_seconds(costs: np.ndarray, remaining: np.ndarray, ybar: np.ndarray, variance: np.ndarray,
                        pace: np.ndarray, pace_variance: np.ndarray) -> np.ndarray:  # fmt: skip
    """costs [K] seconds per round of each bucket (bucket 0, an autoregressive step, has ybar 0 and
    variance 0); remaining [R] tokens each running request has left; ybar, variance [K] of a round's
    accepted drafted tokens; pace, pace_variance [R] -> [K]: the call's expected seconds if every round
    from here used that bucket (module docstring). At least one round."""
    m = remaining[:, None]
    mu = 1.0 + pace[:, None] * ybar  # [R, K]
    rounds = m / mu
    if remaining.size == 1:  # one request: the call ends with its rounds (expected_last weighs no spread)
        return costs * np.maximum(1.0, rounds[0])
    spread = m * variance / mu**3 + (m * ybar / mu**2) ** 2 * pace_variance[:, None]
    return costs * np.maximum(1.0, expected_last(rounds, spread))


@dataclass
class CallTest:
    """The test's answer for a round, and how long it may be kept: an answer decisive by more than
    KEEP_MARGIN serves the next KEEP_ROUNDS rounds while the most tokens a request has left is at least
    half what it was and at least `depth` tokens (the answer changes slowly except near a call's end;
    computing it is most of a pick's host work)."""

    depth: int
    answer: bool = False
    kept: int = 0  # rounds the answer may still serve
    left: float = 0.0  # the most tokens a request had left when it was computed

    def __post_init__(self) -> None:
        _normal_grid()  # at a call's start, not inside its first pick

    def kept_answer(self, most: float) -> bool | None:
        """The last answer if it may serve this round (most: the most tokens a request has left)."""
        if self.kept > 0 and 2.0 * most >= self.left and most >= self.depth:
            self.kept -= 1
            return self.answer
        return None

    def decide(self, seconds: np.ndarray, steps: int, most: float) -> bool:
        """seconds [K]: steady_call_seconds; steps: the index of bucket 0 -> whether to step (its time
        is the least), kept by the rule above."""
        step_time, tree_time = _step_and_tree_times(seconds, steps)
        self.answer, self.left = bool(step_time <= tree_time), most
        self.kept = KEEP_ROUNDS if _decisive(step_time, tree_time) else 0
        return self.answer

    @staticmethod
    def decisive_steps(seconds: np.ndarray, steps: int) -> bool:
        """Whether steps end the call sooner than every bucket by more than KEEP_MARGIN (seconds [K]:
        steady_call_seconds; steps: the index of bucket 0)."""
        step_time, tree_time = _step_and_tree_times(seconds, steps)
        return bool(step_time <= tree_time and _decisive(step_time, tree_time))


def _step_and_tree_times(seconds: np.ndarray, steps: int) -> tuple[float, float]:
    """The steps' time and the least of every other bucket's, from steady_call_seconds."""
    return seconds[steps], seconds[np.arange(seconds.size) != steps].min()


def _decisive(step_time: float, tree_time: float) -> bool:
    """One way ends the call sooner than the other by more than KEEP_MARGIN."""
    return max(step_time, tree_time) / min(step_time, tree_time) - 1.0 > KEEP_MARGIN


@dataclass
class Paces:
    """Each request's pace in a call: the drafted tokens it accepted over what the long-run means of
    the buckets it ran gave for the same rounds (as they stood at each round), with the noise of that
    ratio; and, across a Runner's calls, the spread of pace between requests (its variance, less what
    the rounds' own noise explains), which is what a new call's requests are uncertain by before they
    have run. Host arrays over request rows."""

    spread: float = 0.0  # variance of pace between requests, from the calls so far
    calls: int = 0
    got: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [rows] accepted drafted tokens
    par: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [rows] what the bucket means gave
    noise: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [rows] the rounds' variances summed

    def rows(self, count: int) -> None:
        more = count - self.got.shape[0]
        if more > 0:
            self.got, self.par, self.noise = (np.concatenate([a, np.zeros(more)]) for a in self._arrays())

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.got, self.par, self.noise

    def observe(self, rows: np.ndarray | slice, accepted: np.ndarray, mean: float, variance: float) -> None:
        """A round of those request rows (indices, or a slice of them): the drafted tokens each
        accepted, and the long-run mean and variance of its bucket (Calibration.long_run) as they
        stood."""
        self.got[rows] += accepted
        self.par[rows] += mean
        self.noise[rows] += variance

    def _ratios(self, rows: np.ndarray) -> Pair:
        """(got / par, its noise variance noise / par^2) per row; 1 and inf for a row without rounds."""
        par = self.par[rows]
        seen = par > 0
        if seen.all():  # every row has run: the same divisions, no row to fill in
            return self.got[rows] / par, self.noise[rows] / (par * par)
        safe = np.where(seen, par, 1.0)
        ratio = np.where(seen, self.got[rows] / safe, 1.0)
        return ratio, np.where(seen, self.noise[rows] / (safe * safe), np.inf)

    def estimate(self, rows: np.ndarray) -> Pair:
        """(pace, its variance) per request row: the normal posterior of a pace drawn with the spread
        between requests around 1, seen through got / par."""
        if self.spread <= 0.0:
            return np.ones(rows.size), np.zeros(rows.size)
        ratio, noise = self._ratios(rows)
        weight = self.spread / (self.spread + noise)
        return 1.0 + weight * (ratio - 1.0), self.spread * (1.0 - weight)

    def new_call(self) -> None:
        """Folds the call just ended into the spread between requests (a running mean over calls),
        from the requests whose rounds were worth at least 8 drafted tokens, then starts afresh."""
        ok = np.flatnonzero(self.par >= 8.0)
        if ok.size >= 2:
            ratio, noise = self._ratios(ok)
            spread = max(0.0, float(ratio.var()) - float(noise.mean()))
            self.calls += 1
            self.spread += (spread - self.spread) / self.calls
        self.got, self.par, self.noise = np.zeros(0), np.zeros(0), np.zeros(0)
