"""The host's record of a generate() call's requests: each one's committed tokens, whether it still
runs, and the commit of a round's tokens for the whole batch at once.

A round hands the host, per request row, a count n and a row of token slots (the first n are the
round's committed tokens). `Requests.commit_round` keeps, per running request, at most what its token
limit allows, cut after the first stop token and at the token whose text completes a stop string,
and appends it: numpy over [requests, slots], so that the host's work per round does not grow with
the batch in Python (the stop strings, which decode text, and the streaming callback run per request
that has new tokens, and only when they are set). Up to FEW_REQUESTS requests the same rule runs row
by row in Python (`_commit_rows`): there a numpy call's fixed cost is more than its work, and a round
of a small batch is where the host's work per round shows (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kdtree_engine.engine.text import StopStringMatcher

OnTokens = Callable[[int, list[int]], None]
FEW_REQUESTS = 8  # request rows up to which commit_round runs row by row in Python (_commit_rows)


class Requests:
    """Committed output per request (`limits`: the most tokens each may commit; `stops`: stop token
    ids; `on_tokens(b, tokens)`: called with each request's new tokens; `matchers`: one
    StopStringMatcher per request, or None). A request stops at its limit, after a stop token (kept),
    or at the token that completes a stop string (kept)."""

    def __init__(
        self,
        limits: list[int],
        stops: frozenset[int],
        on_tokens: OnTokens | None,
        matchers: list[StopStringMatcher] | None = None,
    ) -> None:
        self.limits = np.asarray(limits, dtype=np.int64)
        self.lengths = np.zeros(len(limits), dtype=np.int64)
        self.active = self.limits > 0  # [requests] bool
        self.stops = np.array(sorted(stops), dtype=np.int64)
        self._stop_set = frozenset(int(t) for t in stops)
        self.on_tokens, self.matchers = on_tokens, matchers
        self._out = np.zeros((len(limits), 0), dtype=np.int64)  # committed tokens, grown on demand
        self._cols = np.arange(0)

    @property
    def tokens(self) -> list[list[int]]:
        """Each request's committed tokens."""
        return [row[:n].tolist() for row, n in zip(self._out, self.lengths.tolist())]

    def running(self) -> bool:
        return bool(self.active.any())

    def could_end_within(self, tokens: int) -> bool:
        """True when `tokens` more committed tokens could end every running request (reach its limit)."""
        return bool(np.all((self.lengths + tokens >= self.limits) | ~self.active))

    def commit_round(self, tokens: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, bool]:
        """tokens [requests, slots] int64, counts [requests] int64: the round's committed tokens per
        request row (the first counts[b] slots). Appends what each running request keeps, streams it,
        stops the requests it ends. Returns (how many tokens each request kept, [requests] int64, 0 for
        those not running; whether a request stopped)."""
        if len(self.limits) <= FEW_REQUESTS:
            return self._commit_rows(tokens, counts)
        return self._commit_batch(tokens, counts)

    def _commit_batch(self, tokens: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, bool]:
        """commit_round over the whole batch at once (numpy over [requests, slots])."""
        slots = tokens.shape[1]
        kept = np.minimum(np.minimum(counts, self.limits - self.lengths), slots) * self.active
        in_round = self._columns(slots) < kept[:, None]  # [requests, slots]: the slots kept so far
        stopped = None
        if self.stops.size:
            hit = (tokens[:, :, None] == self.stops).any(axis=2) & in_round
            stopped = hit.any(axis=1)
            if stopped.any():
                kept = np.where(stopped, hit.argmax(axis=1) + 1, kept)
                in_round = self._columns(slots) < kept[:, None]
        if self.matchers is not None:
            for b in np.flatnonzero(kept).tolist():
                end = self.matchers[b].feed(tokens[b, : kept[b]].tolist())
                if end is not None:
                    stopped = np.zeros(len(kept), dtype=bool) if stopped is None else stopped
                    kept[b], stopped[b] = end, True
                    in_round[b] = self._columns(slots) < end
        self._append(tokens, kept, in_round)
        ended = self.active & (self.lengths >= self.limits)
        if stopped is not None:
            ended |= stopped & self.active
        changed = bool(ended.any())
        if changed:
            self.active &= ~ended
        if self.on_tokens is not None:
            for b in np.flatnonzero(kept).tolist():
                self.on_tokens(b, tokens[b, : kept[b]].tolist())
        return kept, changed

    def _commit_rows(self, tokens: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, bool]:
        """commit_round row by row in Python (a few requests): the same rule as _commit_batch."""
        limits, lengths, active = self.limits.tolist(), self.lengths.tolist(), self.active.tolist()
        counts, slots = counts.tolist(), tokens.shape[1]
        kept = [0] * len(limits)
        changed = False
        streamed = []  # (row, its new tokens), streamed once every row is committed, as _commit_batch
        for b, running in enumerate(active):
            if not running:
                continue
            new, stopped = self._kept_of_row(b, tokens, min(counts[b], limits[b] - lengths[b], slots))
            kept[b] = len(new)
            if new:
                self._grow(lengths[b] + len(new))
                self._out[b, lengths[b] : lengths[b] + len(new)] = new
                lengths[b] += len(new)
                streamed.append((b, new))
            if stopped or lengths[b] >= limits[b]:
                active[b], changed = False, True
        self.lengths = np.array(lengths, dtype=np.int64)
        if changed:
            self.active[:] = active  # in place, as _commit_batch: callers may hold the array
        if self.on_tokens is not None:
            for b, new in streamed:
                self.on_tokens(b, new)
        return np.array(kept, dtype=np.int64), changed

    def _kept_of_row(self, b: int, tokens: np.ndarray, most: int) -> tuple[list[int], bool]:
        """The tokens running request b keeps of its row (at most `most`: its count, limit and the
        slots), cut after its first stop token or at the token completing a stop string, and whether
        it stopped so."""
        new = tokens[b, : max(most, 0)].tolist()
        stops = self._stop_set
        end = next((i + 1 for i, t in enumerate(new) if t in stops), None) if stops else None
        if end is not None:
            new = new[:end]
        if self.matchers is not None and new:
            hit = self.matchers[b].feed(new)
            if hit is not None:
                new, end = new[:hit], hit
        return new, end is not None

    def _columns(self, slots: int) -> np.ndarray:
        """0 .. slots - 1 (kept between rounds)."""
        if self._cols.shape[0] != slots:
            self._cols = np.arange(slots)
        return self._cols

    def _append(self, tokens: np.ndarray, kept: np.ndarray, in_round: np.ndarray) -> None:
        """Writes each row's first kept[b] tokens (in_round: those slots) after its committed ones."""
        end = self.lengths + kept
        self._grow(int(end.max()) if end.size else 0)
        rows, cols = np.nonzero(in_round)
        self._out[rows, self.lengths[rows] + cols] = tokens[rows, cols]
        self.lengths = end

    def _grow(self, need: int) -> None:
        """Room for `need` committed tokens in every row (grown by doubling, up to the largest limit)."""
        if need > self._out.shape[1]:
            width = max(need, min(2 * self._out.shape[1] + 64, int(self.limits.max())))
            grown = np.zeros((self._out.shape[0], width), dtype=np.int64)
            grown[:, : self._out.shape[1]] = self._out
            self._out = grown
