"""engine.requests.Requests commits a whole round at once (numpy over [requests, slots]); held equal to
the per-request rule it replaces, written here one request at a time: limits, stop tokens at any slot,
stop strings, requests already done, streaming."""

from __future__ import annotations

import numpy as np
import pytest

from kdtree_engine.engine.requests import FEW_REQUESTS, Requests


class SumMatcher:
    """A stand-in stop-string matcher: the text is 'complete' at the token where the running sum of
    the tokens fed reaches `threshold`; feed returns how many of the new tokens to keep, or None."""

    def __init__(self, threshold: int) -> None:
        self.threshold, self.total = threshold, 0

    def feed(self, new: list[int]) -> int | None:
        for i, t in enumerate(new):
            self.total += t
            if self.total >= self.threshold:
                return i + 1
        return None


class OneByOne:
    """The rule, one request at a time."""

    def __init__(self, limits, stops, matchers) -> None:
        self.limits, self.stops, self.matchers = limits, stops, matchers
        self.tokens = [[] for _ in limits]
        self.active = [n > 0 for n in limits]
        self.streamed: list[tuple[int, list[int]]] = []

    def commit_round(self, tokens, counts) -> list[int]:
        kept = [0] * len(self.limits)
        for b, on in enumerate(list(self.active)):
            if on:
                kept[b] = self._commit(b, [int(t) for t in tokens[b][: counts[b]]])
        return kept

    def _commit(self, b: int, new: list[int]) -> int:
        new = new[: self.limits[b] - len(self.tokens[b])]
        end = next((i + 1 for i, t in enumerate(new) if t in self.stops), None)
        if self.matchers is not None:
            hit = self.matchers[b].feed(new[:end])
            end = hit if hit is not None else end
        if end is not None:
            new = new[:end]
            self.active[b] = False
        self.tokens[b].extend(new)
        if len(self.tokens[b]) >= self.limits[b]:
            self.active[b] = False
        if new:
            self.streamed.append((b, new))
        return len(new)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stop_strings", [False, True])
@pytest.mark.parametrize("batch", [FEW_REQUESTS + 1, 3])  # the whole batch at once; row by row (_commit_rows)
def test_a_round_at_once_equals_one_request_at_a_time(seed, stop_strings, batch):
    rng = np.random.default_rng(seed)
    slots = 6
    limits = [int(n) for n in rng.integers(0, 40, batch)]
    limits[0], limits[1] = 0, 1  # done before the first round; done by the prefill's token
    stops = frozenset({3, 7}) if seed % 3 else frozenset()
    thresholds = [int(t) for t in rng.integers(30, 200, batch)]
    matchers = (lambda: [SumMatcher(t) for t in thresholds]) if stop_strings else (lambda: None)
    streamed: list[tuple[int, list[int]]] = []
    ours = Requests(limits, stops, lambda b, new: streamed.append((b, new)), matchers())
    ref = OneByOne(limits, stops, matchers())
    held = ours.active
    for _ in range(40):
        tokens = rng.integers(0, 10, (batch, slots))
        counts = rng.integers(1, slots + 1, batch)
        counts[rng.random(batch) < 0.2] = slots  # whole rows, so that limits fall inside rounds
        was = ours.active.copy()
        kept, changed = ours.commit_round(tokens, counts)
        assert kept.tolist() == ref.commit_round(tokens.tolist(), counts.tolist())
        assert ours.active is held  # updated in place: the engine loop holds the array
        assert ours.active.tolist() == ref.active
        assert changed == (ours.active.tolist() != was.tolist())
        assert ours.tokens == ref.tokens and ours.lengths.tolist() == [len(t) for t in ref.tokens]
        if not ours.running():
            break
    assert streamed == ref.streamed
    for tokens in (1, 3, 8):
        assert ours.could_end_within(tokens) == all(
            len(t) + tokens >= n for t, n, on in zip(ref.tokens, limits, ref.active) if on
        )


def test_a_stop_token_past_the_count_is_not_a_stop():
    reqs = Requests([10, 10], frozenset({5}), None)
    kept, changed = reqs.commit_round(np.array([[1, 2, 5], [5, 1, 1]]), np.array([2, 3]))
    assert kept.tolist() == [2, 1] and changed  # row 0 stops before its slot 2 is counted; row 1 at 5
    assert reqs.tokens == [[1, 2], [5]] and reqs.active.tolist() == [True, False]
    kept, changed = reqs.commit_round(np.array([[4, 4, 4], [9, 9, 9]]), np.array([3, 3]))
    assert kept.tolist() == [3, 0] and not changed  # a done request keeps nothing
    assert reqs.tokens == [[1, 2, 4, 4, 4], [5]]
