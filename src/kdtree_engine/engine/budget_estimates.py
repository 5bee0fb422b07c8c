"""The auto budget's estimates (engine/budget.py): what the drafter's path probabilities are worth in
accepted tokens (Calibration: the fit of accepted tokens on the S the choice saw, with its long-run
values and their uncertainty) and what a round of each bucket costs (CostTable: measured medians)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kdtree_engine.engine.budget_call import Pair

COST_WINDOW = 16  # rounds per bucket whose median is its cost
MIN_COST_ROUNDS = 3  # rounds measured before a bucket's median counts
PRIOR_PAIRS = 4.0  # pseudo-pairs of the calibrated prediction in a bucket's mean acceptance
SLOPE_PAIRS = 16.0  # pairs at which a bucket's fitted slope counts half
EXPLORE_SDS = 2.0  # standard errors above its estimate a tree bucket counts at against a step


def _maximum(x: float, y: float) -> float:
    """np.maximum of two Python floats: the first when not smaller, NaN when either is NaN."""
    return x if x >= y or x != x else y


def _slope(n: float, sx: float, sy: float, sxx: float, sxy: float) -> float:
    """Calibration.slopes() of one bucket from its running sums (n pairs, sums of x, y, x x, x y)."""
    pairs = _maximum(n, 1.0)
    var = sxx - sx * sx / pairs
    cov = sxy - sx * sy / pairs
    slope = _maximum(cov, 0.0) / var if var > 1e-12 * _maximum(1.0, sxx) else 0.0
    return slope * n / (n + SLOPE_PAIRS)


@dataclass
class Calibration:
    """What the drafter's path probabilities are worth, learnt from the rounds read (see the module
    docstring), per bucket index: the accepted drafted tokens against the round's own S (the ratio
    r_n), the level of S over every draft read, and the running sums of the fit of the accepted
    tokens y on the S x the choice saw. Host arrays, updated a round at a time."""

    buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        k = len(self.buckets)
        # the running sums per bucket, rows of one array (observe_nested adds to all at once): pairs n,
        # sums of x, y, x x, x y, the squared misses, and the accepted and predicted of the ratio r_n
        self.sums = np.zeros((8, k))
        self.n, self.sx, self.sy, self.sxx, self.sxy, self.misses, self.accepted, self.predicted = self.sums
        self.level_sums, self.drafts = np.zeros(k), np.zeros(k)
        self._every_drafted = False  # every bucket's count of drafts is above 0 (_undrafted_built)
        # kept results, as arrays and as lists: the coefficients and the long run until the next
        # observation, the levels (with their unknown mask) until the next draft read
        self._coefficients: tuple[Pair, tuple[list[float], list[float]]] | None = None
        self._long_run: tuple[Pair, tuple[list[float], list[float]]] | None = None
        self._levels: tuple[np.ndarray, list[float], np.ndarray | None] | None = None
        self._nearest: tuple[list[bool], list[int]] | None = None  # (buckets tried, the one each borrows)
        self._bonus: tuple[object, np.ndarray] | None = None  # (the long run it was computed from, bonus())
        self._sizes = np.asarray(self.buckets, dtype=np.float64)
        # held (BudgetPolicy.refresh_rounds > 1): an observation keeps the kept results until refresh(),
        # unless it changes what kind of estimate a bucket gets (its first pairs, draft or prediction)
        self.held, self._stale = False, False
        # counts the drops of the kept results: what is derived from them (BudgetPolicy's kept values)
        # stands while this is unchanged
        self.version = 0
        # held, the pairs and drafts of such observations wait here and are added to the sums at once,
        # before anything reads the sums (_add_waiting): one numpy pass over several rounds where each
        # round's own would cost as much (a handful of requests, the calls' fixed cost dominates). Per
        # kind of addition: (its function, its leading arguments, each waiting round's arrays)
        self._waiting: dict[tuple, tuple[Callable, tuple, list[tuple[np.ndarray, ...]]]] = {}

    def _observed(self, first: bool) -> None:
        """After an observation: the kept results dropped now (`first`: a bucket's first of its kind,
        or not held), or at the next refresh()."""
        self._stale = True
        if first or not self.held:
            self.refresh()

    def refresh(self) -> None:
        """Drops the kept results if an observation came since they were computed (its pairs and
        drafts added to the sums first)."""
        self._add_waiting()
        if self._stale:
            self._coefficients = self._long_run = self._levels = None
            self._stale = False
            self.version += 1

    def _take(self, first: bool, add: Callable, head: tuple, arrays: tuple[np.ndarray, ...]) -> None:
        """An observation: add(*head, *arrays) now where it is a bucket's first of its kind or nothing is
        held (then _observed), else waiting with the others of the same add and head (the kept results
        stale either way)."""
        if first or not self.held:
            add(*head, *arrays)
            self._observed(first)
            return
        self._stale = True
        key = (add.__name__, *map(id, head))  # the head is held below: no id is reused meanwhile
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = (add, head, [])
        waiting[2].append(arrays)

    def _add_waiting(self) -> None:
        """The waiting pairs and drafts added to the sums, each kind (each bucket's pairs, each larger
        round's smaller trees, the drafts) in one pass over its rounds' arrays joined."""
        for add, head, rounds in self._waiting.values():
            add(*head, *(np.concatenate(parts) for parts in zip(*rounds, strict=True)))
        self._waiting = {}

    def own_ratio(self, j: int) -> float | None:
        """r_n of bucket index j from its own rounds only (accepted drafted tokens over what their S
        predicted), None before any (ratio() borrows a neighbour's). Read every pick for the chain's
        bucket, whose sums only observe() adds (the chain is no larger tree's nested column, so nothing
        of it waits): it takes no waiting rounds in, which would undo their one pass each pick; a tree
        bucket's value here leaves out its waiting nested rounds until the refresh."""
        predicted = float(self.predicted[j])
        return float(self.accepted[j]) / predicted if predicted > 0 else None

    def observe(self, j: int, accepted: np.ndarray, predicted: np.ndarray) -> None:
        """One round of bucket index j: per running request, the drafted tokens it accepted
        (committed - 1) and the sum S the round's draft predicted for it."""
        self.observe_totals(j, float(accepted.sum()), float(predicted.sum()))

    def observe_totals(self, j: int, accepted: float, predicted: float) -> None:
        """observe() from the round's totals over its requests (a caller that has them already)."""
        first = not self.predicted[j] > 0
        self.accepted[j] += accepted
        self.predicted[j] += predicted
        self._observed(first)

    def observe_drafts(self, sums: np.ndarray) -> None:
        """The S at every bucket of each request of a draft read ([requests, buckets]; NaN at the
        buckets larger than the one built): the levels."""
        self._take(self._undrafted_built(sums), self._add_drafts, (), (sums,))

    def _undrafted_built(self, sums: np.ndarray) -> bool:
        """Whether a draft's S ([requests, buckets]) holds a bucket no draft read before built (once
        every bucket has been drafted, never: the counts only grow)."""
        if self._every_drafted:
            return False
        if 0.0 not in self.drafts.tolist():
            self._every_drafted = True
            return False
        undrafted = self.drafts == 0
        return bool((undrafted & ~np.isnan(sums).all(axis=0)).any())

    def _add_drafts(self, sums: np.ndarray) -> None:
        known = ~np.isnan(sums)
        self.level_sums += np.where(known, sums, 0.0).sum(axis=0)
        self.drafts += known.sum(axis=0)

    def observe_choices(self, j: int, seen: np.ndarray, accepted: np.ndarray,
                        expected: np.ndarray | None = None) -> None:  # fmt: skip
        """The requests of a round of bucket index j: the S at that bucket their choice saw, the
        drafted tokens they then accepted, and the E their choice expected (the squared misses: what
        a choice cannot foresee; None: the E the fit gives for that S now)."""
        if expected is None:
            a, b = self.expected_coefficients()
            expected = np.maximum(1.0, a[j] + b[j] * seen)
        self._take(bool(self.n[j] == 0), self._add_pairs, (j,), (seen, accepted, expected))

    def _add_pairs(self, j: int, seen: np.ndarray, accepted: np.ndarray, expected: np.ndarray) -> None:
        miss = accepted + 1.0 - expected
        self.sums[:6, j] += (seen.size, seen.sum(), accepted.sum(), seen @ seen, seen @ accepted, miss @ miss)

    def observe_nested(self, columns: np.ndarray, seen: np.ndarray, accepted: np.ndarray,
                       predicted: np.ndarray, coefficients: Pair) -> None:  # fmt: skip
        """observe_choices and observe of the bucket indices `columns` at once, for a round that ran a
        larger tree ([requests, columns] each: the S the choice saw, the drafted tokens each would have
        accepted, its own S of this draft); the misses against `coefficients`, the fit (a, b) as it
        stood before the round."""
        pairs, told = self.n.tolist(), self.predicted.tolist()
        first = any(pairs[c] == 0 or not told[c] > 0 for c in columns.tolist())
        # (the fit before the round is the kept one: the same object for every round that waits)
        self._take(first, self._add_nested, (columns, coefficients), (seen, accepted, predicted))

    def _add_nested(self, columns: np.ndarray, coefficients: Pair, seen: np.ndarray, accepted: np.ndarray,
                    predicted: np.ndarray) -> None:  # fmt: skip
        a, b = coefficients
        miss = accepted + 1.0 - np.maximum(1.0, a[columns] + b[columns] * seen)
        terms = np.stack([seen, accepted, seen * seen, seen * accepted, miss * miss, predicted]).sum(axis=1)
        pairs = np.full(columns.size, float(seen.shape[0]))  # a row of ones summed: the request count
        self.sums[:, columns] += np.stack([pairs, *terms[:5], terms[1], terms[5]])

    def ratio(self, j: int) -> float:
        """r_n of bucket index j: accepted / predicted of this bucket, else of the nearest bucket with
        a prediction (the smaller of two as near), else 1 (a calibrated drafter)."""
        return float(self.ratios()[j])

    def ratios(self) -> np.ndarray:
        """ratio(j) of every bucket index j, at once."""
        return np.array(self._ratio_values())

    def _ratio_values(self) -> list[float]:
        """ratios() as Python floats (the same divisions, one per bucket)."""
        self._add_waiting()
        predicted = self.predicted.tolist()
        tried = [p > 0 for p in predicted]
        if not any(tried):
            return [1.0] * len(self.buckets)
        if self._nearest is None or self._nearest[0] != tried:  # changes only when a bucket is first tried
            sizes = self._sizes
            far = np.abs(sizes[None, :] - sizes[:, None]) * (2.0 * sizes.max() + 2.0) + sizes[None, :]
            far = np.where(np.array(tried)[None, :], far, np.inf)
            borrows = far.argmin(axis=1)  # [j]: the bucket it borrows
            self._nearest = tried, borrows.tolist()
        accepted = self.accepted.tolist()
        return [accepted[i] / predicted[i] for i in self._nearest[1]]

    def levels(self) -> np.ndarray:
        """The mean S at each bucket over every draft read that built it (NaN before any)."""
        return self._level_values()[0]

    def unknown_levels(self) -> np.ndarray | None:
        """np.isnan(levels()), or None where every level is known."""
        return self._level_values()[2]

    def _level_values(self) -> tuple[np.ndarray, list[float], np.ndarray | None]:
        """levels() as an array and as a list, and unknown_levels(), kept until the next draft read."""
        if self._levels is None:
            self._add_waiting()
            sums, drafts = self.level_sums.tolist(), self.drafts.tolist()
            values = [x / _maximum(d, 1.0) if d > 0 else math.nan for x, d in zip(sums, drafts)]
            levels = np.array(values)
            unknown = np.isnan(levels)
            self._levels = levels, values, unknown if unknown.any() else None
        return self._levels

    def slopes(self) -> np.ndarray:
        """Per bucket, the least-squares slope of y on x, >= 0, shrunk by n / (n + SLOPE_PAIRS);
        0 without pairs or without spread in x."""
        self._add_waiting()
        columns = (self.n.tolist(), self.sx.tolist(), self.sy.tolist(), self.sxx.tolist(), self.sxy.tolist())
        return np.array([_slope(*sums) for sums in zip(*columns)])

    def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) per bucket: a request's E(n) = max(1, a + b x) for the S x its choice sees (module
        docstring). Without pairs: 1 + r x; bucket 0 (autoregressive): 1."""
        a, b = self._coefficient_values()
        return np.array(a), np.array(b)

    def _coefficient_values(self) -> tuple[list[float], list[float]]:
        """coefficients() as Python floats, bucket by bucket: the operations of the array form, in
        the same order (six buckets: a numpy call costs more than the arithmetic it does)."""
        a, b = [], []
        self._add_waiting()
        columns = (self.n.tolist(), self.sx.tolist(), self.sy.tolist(), self.sxx.tolist(), self.sxy.tolist())
        levels = self._level_values()[1]
        for size, ratio, level, (n, sx, sy, sxx, sxy) in zip(
            self.buckets, self._ratio_values(), levels, zip(*columns), strict=True
        ):
            a_k, b_k = 1.0, 0.0  # bucket 0
            if size != 0:
                beta = _slope(n, sx, sy, sxx, sxy)
                pairs = _maximum(n, 1.0)
                prior = ratio * (sx / pairs if math.isnan(level) else level)
                mean_y = (sy + PRIOR_PAIRS * prior) / (n + PRIOR_PAIRS)
                fitted = n > 0
                a_k = 1.0 + mean_y - beta * sx / pairs if fitted else 1.0
                b_k = beta if fitted else ratio
            a.append(a_k)
            b.append(b_k)
        return a, b

    def long_run(self) -> tuple[np.ndarray, np.ndarray]:
        """(ybar, var) per bucket: the drafted tokens a round accepts in the long run (E at the
        bucket's level of S, less the bonus token; 0 before a draft built it) and the variance of what
        a choice cannot foresee of them (the pairs' squared misses, shrunk towards a geometric count's
        ybar (1 + ybar) by PRIOR_PAIRS pseudo-pairs); 0 and 0 for bucket 0."""
        return self._long_run_pair()[0]

    def long_run_values(self) -> tuple[list[float], list[float]]:
        """long_run() as lists of Python floats."""
        return self._long_run_pair()[1]

    def bonus(self) -> np.ndarray:
        """Per bucket, EXPLORE_SDS standard errors of its long-run accepted drafted tokens: the root of
        its variance (long_run) over its pairs and PRIOR_PAIRS; 0 for bucket 0 (a step commits one
        token, known). Kept with the long run it comes from (both change only with an observation);
        read-only."""
        pair = self._long_run_pair()
        if self._bonus is None or self._bonus[0] is not pair:
            self._add_waiting()
            _, variance = pair[0]
            bonus = EXPLORE_SDS * np.sqrt(variance / (self.n + PRIOR_PAIRS))
            self._bonus = pair, np.where(self._sizes == 0, 0.0, bonus)
        return self._bonus[1]

    def optimistic_long_run(self) -> tuple[np.ndarray, np.ndarray]:
        """long_run() with each tree bucket's accepted tokens raised by bonus(): what the trees may
        still be worth, for weighing them against steps."""
        ybar, variance = self.long_run()
        return ybar + self.bonus(), variance

    def _long_run_pair(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[list[float], list[float]]]:
        """long_run() as arrays and as lists, kept until the next observation."""
        if self._long_run is not None:
            return self._long_run  # nothing observed since
        self._add_waiting()
        a, b = self._coefficient_pair()[1]
        ybar, var = [], []
        columns = (self._level_values()[1], self.misses.tolist(), self.n.tolist())
        for size, a_k, b_k, level, misses, n in zip(self.buckets, a, b, *columns, strict=True):
            y = 0.0 if math.isnan(level) else _maximum(0.0, a_k + b_k * level - 1.0)
            v = (misses + PRIOR_PAIRS * y * (1.0 + y)) / (n + PRIOR_PAIRS)
            ybar.append(0.0 if size == 0 else y)
            var.append(0.0 if size == 0 else v)
        self._long_run = (np.array(ybar), np.array(var)), (ybar, var)
        return self._long_run

    def expected_coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        """coefficients(), kept until the next observation (autoregressive rounds teach nothing)."""
        return self._coefficient_pair()[0]

    def _coefficient_pair(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[list[float], list[float]]]:
        """expected_coefficients() as arrays and as lists."""
        if self._coefficients is None:
            a, b = self._coefficient_values()
            self._coefficients = (np.array(a), np.array(b)), (a, b)
        return self._coefficients

    def expected(self, seen: np.ndarray) -> np.ndarray:
        """E(n) of each request at each bucket ([requests, buckets]) for the S its choice sees."""
        a, b = self.expected_coefficients()
        return np.maximum(1.0, a + b * seen)


@dataclass
class CostTable:
    """Measured seconds per round of each bucket at one batch size: the median of the last COST_WINDOW.
    `fallback`: the table of the other timing mode (BudgetPolicy.new_call), which prices a bucket this
    one has not measured yet."""

    buckets: tuple[int, ...]
    times: dict[int, deque] = field(default_factory=dict)
    fallback: CostTable | None = None
    _estimates: dict[int, float] = field(default_factory=dict)  # estimate() per bucket, until observed
    _all: tuple[np.ndarray, list[float], bool] | None = None  # estimates(), until the next observation
    _own: dict[int, float] = field(default_factory=dict)  # own() per bucket, until it is observed
    _shift_kept: float | None = None  # _shift(), until the next observation here or a new call
    held: bool = False  # (BudgetPolicy.refresh_rounds > 1) estimates kept until refresh(), as Calibration's
    _stale: bool = False
    version: int = 0  # counts the drops of the cached estimates, as Calibration.version

    def observe(self, bucket: int, seconds: float) -> None:
        times = self.times.get(bucket)
        if times is None:
            times = self.times[bucket] = deque(maxlen=COST_WINDOW)
        times.append(float(seconds))
        self._own.pop(bucket, None)
        self._stale = True
        if not self.held or len(times) == MIN_COST_ROUNDS:  # unheld, or the round that first gives a median
            self.refresh()

    def refresh(self) -> None:
        """Drops the cached estimates if a round was observed since they were computed."""
        if self._stale:
            self.forget_estimates()

    def forget_estimates(self) -> None:
        """Drops the cached estimates (after an observation, here or in the fallback)."""
        self._estimates.clear()
        self._all = None
        self._shift_kept = None
        self._stale = False
        self.version += 1

    def measured(self, bucket: int) -> float | None:
        t = self.times.get(bucket)
        return statistics.median(t) if t else None

    def own(self, bucket: int) -> float:
        """The bucket's median, or 0 for one measured fewer than MIN_COST_ROUNDS times."""
        if bucket not in self._own:
            t = self.times.get(bucket)
            self._own[bucket] = statistics.median(t) if t and len(t) >= MIN_COST_ROUNDS else 0.0
        return self._own[bucket]

    def estimate(self, bucket: int) -> float:
        """The bucket's median, once measured MIN_COST_ROUNDS times. Before that, a tree bucket is
        priced from the trees measured here (a round's cost grows with its tree): between two, on the
        line between their medians; where the fallback has measured it, above them all at the largest
        one's median (it costs at least that) and below them all at the fallback's price shifted by
        the median difference between the two tables over the buckets both have measured, but no more
        than the smallest one's median. Otherwise (the step, or no tree measured here) the fallback's
        shifted price (none measured in both: unshifted; a stage-timed round costs about a fixed host
        sync more than an untimed one), or else 0, so that every bucket gets tried (an autoregressive
        step costs far less than any tree, which no neighbour tells; and a bucket never built has no
        draft's S to judge it by). An unmeasured bucket is never priced above what the measured ones
        imply: the fallback's prices are the other timing mode's, whose stage syncs make them noisy,
        and a bucket priced too dear is never picked, so never measured here."""
        if bucket not in self._estimates:
            price = self.own(bucket)
            lower, upper = self._neighbours(bucket) if price <= 0 and bucket > 0 else (None, None)
            if lower is not None and upper is not None:
                (k0, c0), (k1, c1) = lower, upper
                price = c0 + (c1 - c0) * (bucket - k0) / (k1 - k0)
            other = self.fallback.own(bucket) if self.fallback is not None and price <= 0 else 0.0
            if other > 0 and lower is not None:
                price = lower[1]
            elif other > 0:
                price = max(other + self._shift(), 0.1 * other)
                price = min(price, upper[1]) if upper is not None else price
            self._estimates[bucket] = price
        return self._estimates[bucket]

    def _neighbours(self, bucket: int) -> tuple[tuple[int, float] | None, tuple[int, float] | None]:
        """The nearest tree buckets below and above `bucket` measured here, as (bucket, median), or
        None where there is none."""
        measured = [(k, self.own(k)) for k in self.buckets if k > 0 and self.own(k) > 0]
        lower = [kc for kc in measured if kc[0] < bucket]
        upper = [kc for kc in measured if kc[0] > bucket]
        return (max(lower) if lower else None), (min(upper) if upper else None)

    def _shift(self) -> float:
        """The median of (own - fallback) over the buckets both have measured; 0 for none."""
        if self._shift_kept is None:
            both = [self.own(k) - self.fallback.own(k) for k in self.buckets
                    if self.own(k) > 0 and self.fallback.own(k) > 0]  # fmt: skip
            self._shift_kept = float(statistics.median(both)) if both else 0.0
        return self._shift_kept

    def estimates(self) -> tuple[np.ndarray, list[float], bool]:
        """estimate() of every bucket, as an array and as a list, and whether a bucket is unmeasured
        (an estimate of 0 or less)."""
        if self._all is None:
            values = [float(self.estimate(k)) for k in self.buckets]
            self._all = np.array(values), values, any(c <= 0 for c in values)
        return self._all
