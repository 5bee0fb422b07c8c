"""Generation statistics and per-stage timers. On CUDA the timers record events around each stage and
read them after the round's one synchronisation, so timing adds no device syncs; on the CPU, where
work is synchronous, they read the clock."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

STAGES = ("prefill", "draft", "tree_build", "compile", "verify", "accept", "commit")


class StageTimer:
    """Accumulates seconds per stage. enabled=False times nothing; now() syncs the device (wall time)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.times = dict.fromkeys(STAGES, 0.0)
        self._pending: list[tuple[str, object, object]] = []

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        if not self.enabled:
            yield
            return
        if not self.cuda:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.times[name] += time.perf_counter() - t0
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((name, begin, end))

    @contextmanager
    def host_stage(self, name: str):
        """A stage of host work (reading the round's results, committing tokens): the host's clock."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                self.times[name] += time.perf_counter() - t0

    def collect(self, wait: bool = True) -> None:
        """Adds the times of the recorded stages, in order: all of them (waiting for the device), or
        with wait=False those that have finished, up to the first that has not."""
        while self._pending:
            name, begin, end = self._pending[0]
            if not wait and not end.query():
                break
            end.synchronize()
            self.times[name] += begin.elapsed_time(end) / 1e3
            self._pending.pop(0)

    def drop_last(self, count: int) -> None:
        """Forgets the last `count` recorded stages, not collected yet (a round whose results are
        discarded)."""
        if count > 0:
            del self._pending[-count:]


@dataclass
class GenerationStats:
    """Counts for one generate() call over the whole batch.

    target_forwards includes the prefill; accept_lengths holds one entry per (request, verify round)
    with the number of tokens that round committed to the request (accepted drafted tokens + the bonus
    token, i.e. the accepted nodes including the root, cut where the request reached its limit, a stop
    token or a stop string: only what the output holds). rounds: decoding rounds after the prefill
    (the batch runs every round, finished requests included, until all are done)."""

    method: str
    batch_size: int
    new_tokens: list[int] = field(default_factory=list)
    target_forwards: int = 0
    drafter_forwards: int = 0
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    wall_time: float = 0.0  # seconds of the whole call, prefill and graph capture included
    cuda_graphs: bool = False
    capture_time: float = 0.0  # seconds spent capturing CUDA graphs (once per call, after round 1)
    discarded_rounds: int = 0  # rounds enqueued past the end (after a stop; engine.loop), not in `rounds`
    eager_rounds: int = 0  # rounds past a call's first run eagerly although graphs are on (not captured yet)
    budgets: list[int] = field(default_factory=list)  # budget "auto": each round's bucket, in order
    # budget "auto": per round, why the policy picked its bucket (engine.budget.PICK_REASONS), the
    # batch's expected tokens at every bucket it weighed (None in a call given to steps), and the
    # steady rate (tokens per second) and seconds per bucket the per-round rule weighed (None where the
    # rule did not decide)
    budget_picks: list[tuple[str, list[float] | None, float | None, list[float] | None]] = field(
        default_factory=list
    )
    budget_report: dict = field(default_factory=dict)  # budget "auto": engine.budget.BudgetPolicy.report()
    round_seconds: list[float] = field(default_factory=list)  # each round's measured cost (NaN: not measured)

    @property
    def total_new_tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def mean_accept_len(self) -> float:
        """Tokens committed per verify round per request (1.0 for autoregressive decoding)."""
        if not self.accept_lengths:
            return 1.0
        return sum(self.accept_lengths) / len(self.accept_lengths)

    @property
    def round_time(self) -> float:
        """Seconds per decoding round: the wall time less the prefill (when timed) and the one-time
        graph capture, over the rounds (nan without rounds)."""
        if not self.rounds:
            return float("nan")
        decoding = self.wall_time - self.stage_times.get("prefill", 0.0) - self.capture_time
        return decoding / self.rounds

    @property
    def accept_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))

    @property
    def tokens_per_s(self) -> float:
        return self.total_new_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def budget_histogram(self) -> dict[int, int]:
        """Budget "auto": rounds per chosen bucket."""
        return dict(sorted(Counter(self.budgets).items()))

    def summary(self) -> str:
        timed = [f"{k} {v * 1e3:.1f} ms" for k, v in self.stage_times.items() if v > 0]
        stages = ", ".join(timed) or "not timed"
        hist = " ".join(f"{k}:{v}" for k, v in self.accept_histogram.items())
        return (
            f"[{self.method}] {self.total_new_tokens} new tokens (batch {self.batch_size}) in "
            f"{self.target_forwards} target forwards, {self.drafter_forwards} drafter forwards; "
            f"mean accepted length {self.mean_accept_len:.2f}"
            + (f" (histogram {hist})" if hist else "")
            + f"; {self.tokens_per_s:.1f} tokens/s"
            + (" (CUDA graphs)" if self.cuda_graphs else "")
            + (
                "; budgets chosen " + " ".join(f"{k}:{v}" for k, v in self.budget_histogram.items())
                if self.budgets
                else ""
            )
            + f"; stages: {stages}"
        )


def round_cost(stats: GenerationStats, base: GenerationStats) -> str:
    """One line on what the speedup of `stats` over `base` (autoregressive decoding of the same
    prompts) comes from: a round commits tau = mean accepted length tokens per request and costs c
    decode steps of `base` (by stage, the largest first, when timed), so the decoding speedup is about
    tau / c (the prefill aside). DDTree wins where a round costs fewer decode steps than it commits."""
    step = base.round_time
    if not step > 0 or not stats.round_time > 0:
        return "no decoding rounds to compare"
    cost, tau = stats.round_time / step, stats.mean_accept_len
    per_stage = {k: v / stats.rounds / step for k, v in stats.stage_times.items() if k != "prefill" and v > 0}
    top = sorted(per_stage.items(), key=lambda kv: -kv[1])[:3]
    parts = f" ({', '.join(f'{k} {v:.2f}' for k, v in top)}{', ...' if len(per_stage) > 3 else ''})"
    return (
        f"a round costs {cost:.2f} decode steps{parts if top else ''} and commits {tau:.2f} tokens: "
        f"speedup about {tau:.2f} / {cost:.2f} = {tau / cost:.2f}x"
    )
