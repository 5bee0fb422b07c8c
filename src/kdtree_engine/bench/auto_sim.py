"""A simulator of the auto budget's choices on a static batch, without a model: the engine's own
`BudgetPolicy` picks and observes synthetic rounds whose acceptance and cost follow a stated model, and
the calls' tokens per second are compared with autoregressive decoding and every fixed bucket on the
same requests. It checks the policy's logic (the estimator, the choice, the pipelined reads, the
static batch's tail) on the CPU, where no real round costs what it costs on a GPU; it measures nothing
about a GPU. `scripts/simulate_auto_budget.py` prints its table.

The model of a round. Request b has a skill s_b (a logit, drawn once per call) and a difficulty e that
follows an AR(1) process over its rounds (`persistence`, `round_noise`): its per-step acceptance is
a = sigmoid(s_b + e). A tree of bucket n reaches depth DEPTH[n] and, being wider, turns a step's
rejection chance 1 - a into (1 - a) WIDTH[n]; the drafted tokens it accepts are the leading steps whose
uniform falls under its step acceptance (the uniforms shared by every bucket, so a larger tree never
accepts less on the same round). The draft's sums S_b(k) (what the engine's compile stage hands the
policy) are the expected accepted tokens at each bucket k <= n under the drafter's view of a, which
is off by a normal error of sd `draft_noise` on the logit. Or the rounds replay kimi-nano's recorded
acceptance (`Trace`). A round of bucket n costs costs_ms[n] at this batch, times a small noise; an
autoregressive step commits one token.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kdtree_engine.engine.budget import (
    AUTO_BUCKETS,
    REFRESH_ROUNDS,
    STEP_ROUNDS,
    BudgetPolicy,
    auto_buckets,
    chain_bucket,
)

BLOCK = 16  # the drafter's block, L + 1
DEPTH = {4: 3, 8: 4, 16: 6, 32: 8, 64: 10}  # the deepest node of a tree of n nodes (best-first)
WIDTH = {4: 1.0, 8: 0.8, 16: 0.65, 32: 0.55, 64: 0.5}  # a step's rejection chance, relative to a chain


@dataclass(frozen=True)
class Scenario:
    """One simulated setting: the batch, the round costs in ms per bucket (0: an autoregressive step),
    and the acceptance model, or recorded traces to replay."""

    name: str
    batch: int
    costs_ms: dict[int, float]
    skill_mean: float = 1.5
    skill_spread: float = 0.7
    persistence: float = 0.8
    round_noise: float = 0.8
    draft_noise: float = 0.3
    tokens: int = 128
    cost_noise: float = 0.03
    traces: tuple[Trace, ...] = ()  # recorded rounds to replay instead of the acceptance model
    buckets: tuple[int, ...] = AUTO_BUCKETS  # with DFlash's chain (auto_buckets(CHAIN)) on greedy traces
    # the requests as `bench e2e` makes them: the first bench_prompts traces (recorded from the held-out
    # prompts in order) cycled over the batch, each from its first token, the same in every call; None:
    # each request a random trace from a random text position
    bench_prompts: int | None = None
    greedy: bool = False  # the traces are greedy: requests of one prompt are copies (their tokens the same)


@dataclass(frozen=True)
class Trace:
    """One request's recorded rounds (scripts/record_acceptance_traces.py): each round's start, in
    tokens committed before it, and the tokens and sums S a tree of every bucket gave there
    ([rounds, buckets]). Replayed by text position: a request at position p gets the round recorded at
    the last start <= p (wrapping around past the end)."""

    starts: np.ndarray
    counts: np.ndarray
    sums: np.ndarray
    chain_counts: np.ndarray | None = None  # [rounds]: what the chain would have committed (greedy)
    chain_sums: np.ndarray | None = None  # [rounds]: the chain's S

    @property
    def length(self) -> int:
        return int(self.starts[-1] + self.counts[-1, -1])

    def at(self, position: int) -> int:
        return int(np.searchsorted(self.starts, position % self.length, side="right") - 1)


def counts_at_buckets(accepted: np.ndarray) -> list[int]:
    """accepted: one request's accepted node indices from a tree of the largest bucket (root 0 first,
    -1 padded) -> the tokens a tree of each bucket would have committed on that round: 1 + the path's
    nodes whose index is at most the bucket (the first k nodes of a best-first tree are the tree of
    budget k, and node indices grow along a path)."""
    path = accepted[1:][accepted[1:] > 0]
    return [1 + int((path <= k).sum()) for k in AUTO_BUCKETS]


def chain_count(
    parents: np.ndarray, tokens: np.ndarray, targets: np.ndarray, top1: np.ndarray
) -> tuple[int, bool]:
    """What DFlash's chain (the top-1 token of each drafted position, one under the other) would have
    committed on a greedy round verified as a best-first tree: parents [n + 1] and tokens [n] (node i +
    1's) of the tree, targets [n + 1] the target's argmax at each node, top1 [L] the draft's top-1 per
    position. The chain accepts position d while the target's token at its node d - 1 is top1[d - 1];
    those nodes are the tree's as far as it holds them, so the count is exact until the chain runs past
    the tree's nodes. -> (count, censored): censored when the chain had accepted every position the tree
    holds and the next one is not in it (count is then a lower bound)."""
    child = {(int(p), int(t)): j for j, (p, t) in enumerate(zip(parents[1:], tokens), start=1) if p >= 0}
    node = 0
    for d, token in enumerate(top1.tolist(), start=1):
        if int(targets[node]) != token:
            return d, False  # d - 1 accepted, then the target's own token
        node = child.get((node, token), -1)
        if node < 0:  # position d accepted; what follows is not in the tree (unless d was the last)
            return d + 1, d < len(top1)
    return len(top1) + 1, False


def load_traces(path, temperature: str) -> tuple[Trace, ...]:
    """The traces of one temperature ("0", "1") from a file written by
    scripts/record_acceptance_traces.py (recorded at the largest bucket, so each round's start
    advances by its count there)."""
    data = json.loads(Path(path).read_text())
    if list(data["buckets"]) != list(AUTO_BUCKETS):
        raise ValueError(f"{path}: recorded for buckets {data['buckets']}, not {AUTO_BUCKETS}")
    out = []
    for rounds in data["temperatures"][temperature]:
        if not rounds:
            continue
        counts = np.array([r["counts"] for r in rounds], dtype=np.int64)
        sums = np.array([r["sums"] for r in rounds], dtype=np.float64)
        starts = np.concatenate([[0], np.cumsum(counts[:-1, -1])])
        chain = [r["chain"] for r in rounds if "chain" in r]
        if len(chain) == len(rounds):
            chain_counts = np.array([c["count"] for c in chain], dtype=np.int64)
            out.append(Trace(starts, counts, sums, chain_counts, np.array([c["sum"] for c in chain])))
        else:
            out.append(Trace(starts, counts, sums))
    return tuple(out)


@dataclass
class _Requests:
    """The simulated requests of one call: skills, difficulties, committed counts; with traces, each
    one's trace and the text position where its replay starts."""

    skill: np.ndarray
    difficulty: np.ndarray
    trace: np.ndarray | None = None
    offset: np.ndarray | None = None
    committed: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.committed = np.zeros(self.skill.shape[0], dtype=np.int64)


def copies(sc: Scenario, group: int = 0) -> list[int] | None:
    """What generate() tells the policy of a call's requests (BudgetPolicy.new_call): under greedy
    decoding, per request the first of its copies, the bench's requests cycling their prompts over the
    batch; None otherwise (random text positions: no two requests alike)."""
    if not (sc.greedy and sc.traces and sc.bench_prompts):
        return None
    traces = _bench_traces(sc, group)
    return [int(np.flatnonzero(traces == t)[0]) for t in traces]


def bench_groups(sc: Scenario) -> int:
    """How many calls of sc.batch requests `bench e2e --prompts sc.bench_prompts` makes (each on a
    Runner of its own): the prompts b at a time, cycling to fill the last call; 1 without bench prompts."""
    if not (sc.traces and sc.bench_prompts):
        return 1
    return -(-min(sc.bench_prompts, len(sc.traces)) // sc.batch)


def _bench_traces(sc: Scenario, group: int = 0) -> np.ndarray:
    """The trace of each request of the bench's call `group` (bench e2e --prompts sc.bench_prompts):
    the prompts b at a time, cycling over them (the first row of a trace's requests is its index
    modulo the prompts)."""
    return (np.arange(sc.batch) + group * sc.batch) % min(sc.bench_prompts, len(sc.traces))


def _new_requests(sc: Scenario, rng: np.random.Generator, group: int = 0) -> _Requests:
    skill = rng.normal(sc.skill_mean, sc.skill_spread, sc.batch)
    reqs = _Requests(skill, rng.normal(0.0, sc.round_noise, sc.batch))
    if sc.traces and sc.bench_prompts:
        reqs.trace = _bench_traces(sc, group)
        reqs.offset = np.zeros(sc.batch, dtype=np.int64)
    elif sc.traces:
        reqs.trace = rng.integers(0, len(sc.traces), sc.batch)
        reqs.offset = np.array([rng.integers(0, sc.traces[t].length) for t in reqs.trace])
    return reqs


def _trace_round(sc: Scenario, reqs: _Requests, n: int) -> tuple[np.ndarray, ...]:
    """_round from the traces: each request's recorded round at its text position. With the chain among
    sc.buckets: a tree round also tells the chain's S; the chain's round tells its own count and S."""
    buckets, chain = sc.buckets, chain_bucket(sc.buckets)
    counts = np.ones(sc.batch, dtype=np.int64)
    sums = np.full((sc.batch, len(buckets)), np.nan)
    would = np.full((sc.batch, len(buckets)), np.nan)
    trees = [j for j, k in enumerate(buckets) if k != chain]  # the columns of AUTO_BUCKETS, in order
    for b in range(sc.batch):
        trace = sc.traces[reqs.trace[b]]
        r = trace.at(int(reqs.offset[b] + reqs.committed[b] - 1))
        if n == chain:
            counts[b] = trace.chain_counts[r]
            sums[b, buckets.index(chain)] = trace.chain_sums[r]
            would[b, buckets.index(chain)] = counts[b]
            continue
        j = AUTO_BUCKETS.index(n)
        counts[b] = trace.counts[r, j]
        if n:
            told = [trees[i] for i in range(j + 1)]
            sums[b, told] = trace.sums[r, : j + 1]
            would[b, told[1:]] = trace.counts[r, 1 : j + 1]
            if chain is not None:
                sums[b, buckets.index(chain)] = trace.chain_sums[r]
    return counts, sums, would


def _step_acceptance(logit: np.ndarray, n: int) -> np.ndarray:
    return 1.0 - (1.0 - 1.0 / (1.0 + np.exp(-logit))) * WIDTH[n]


def _round(sc: Scenario, reqs: _Requests, n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """One round of bucket n for every request: (committed tokens [B], sums [B, buckets], NaN past n,
    and what each tree bucket k <= n would have committed on the same round, NaN elsewhere).
    Advances the difficulties."""
    if sc.traces:
        return _trace_round(sc, reqs, n)
    if sc.buckets != AUTO_BUCKETS:
        raise ValueError("buckets: the acceptance model has no chain (replay traces recorded with it)")
    b = sc.batch
    buckets = AUTO_BUCKETS
    sums = np.full((b, len(buckets)), np.nan)
    would = np.full((b, len(buckets)), np.nan)
    if n == 0:
        counts = np.ones(b, dtype=np.int64)
    else:
        logit = reqs.skill + reqs.difficulty
        view = logit + rng.normal(0.0, sc.draft_noise, b)
        u = rng.random((b, max(DEPTH.values())))  # the same uniforms for every bucket
        for j, k in enumerate(buckets):
            if k == 0:
                sums[:, j] = 0.0
            elif k <= n:
                a = _step_acceptance(view, k)
                sums[:, j] = sum(a**d for d in range(1, DEPTH[k] + 1))
                steps = u[:, : DEPTH[k]] < _step_acceptance(logit, k)[:, None]
                would[:, j] = 1 + np.cumprod(steps, axis=1).sum(axis=1)
        counts = would[:, buckets.index(n)].astype(np.int64)
    shock = rng.normal(0.0, sc.round_noise * np.sqrt(1.0 - sc.persistence**2), b)
    reqs.difficulty = sc.persistence * reqs.difficulty + shock
    return counts, sums, would


def _cost(sc: Scenario, n: int, rng: np.random.Generator) -> float:
    return sc.costs_ms[n] * 1e-3 * (1.0 + sc.cost_noise * rng.standard_normal())


def run_call(sc: Scenario, seed: int, bucket: int | None, policy: BudgetPolicy | None = None,
             static: bool = True, group: int = 0) -> dict:  # fmt: skip
    """One static call: every request decodes sc.tokens tokens (the prefill's first one included).
    bucket: a fixed bucket (0: plain autoregressive decoding), or None for the policy's choice. Returns
    the call's seconds, rounds and the buckets picked. Rounds are pipelined as on CUDA: the pick of
    round k + 1 is made before round k is read. static: the policy is told each request's tokens left
    (as generate() tells it); False: not (its rule for a batch whose finished rows are refilled).
    group: which of the bench's calls (bench_groups) replays, with bench prompts."""
    rng = np.random.default_rng(seed)
    reqs = _new_requests(sc, rng, group)
    reqs.committed[:] = 1  # the prefill's token
    seconds, picks = 0.0, []
    flight: deque = deque()
    first = True

    def running() -> np.ndarray:
        return reqs.committed < sc.tokens

    def pick() -> int:
        nonlocal first
        if policy is None:
            return bucket
        k = policy.pick(
            running(), must_draft=first, remaining=(sc.tokens - reqs.committed) if static else None
        )
        first = False
        return k

    while running().any():
        if not flight:
            flight.append(pick())
        if policy is not None and not np.all(reqs.committed + 1 >= sc.tokens):
            flight.append(pick())
        if policy is not None:  # where the engine's loop refreshes (BudgetPolicy.defer_refresh)
            policy.refresh_when_due(running())
        n = flight.popleft()
        rows = np.flatnonzero(running())
        counts, sums, would = _round(sc, reqs, n, rng)
        cost = _cost(sc, n, rng)
        seconds += cost
        picks.append(n)
        if policy is not None:
            policy.observe(n, cost, rows, counts, sums if n else None, would if n else None)
        reqs.committed = np.minimum(reqs.committed + np.where(running(), counts, 0), sc.tokens)
    if policy is not None and flight:  # the round enqueued past the end: its device time is spent
        seconds += _cost(sc, flight.popleft(), rng)
    return {"seconds": seconds, "rounds": len(picks), "picks": picks}


# Settings whose round costs have the shape of kimi-nano's on the GPU (docs/engine.md, "Budget auto";
# ms per round, autoregressive step first) and whose acceptance is greedy-like (high, persistent from
# round to round) or sampled-like (lower, hardly persistent). Illustrative: the acceptance model is
# not fitted to the drafter.
B1 = {0: 0.50, 4: 0.95, 8: 1.0, 16: 1.05, 32: 1.15, 64: 1.35}
B4 = {0: 0.50, 4: 0.97, 8: 1.02, 16: 1.1, 32: 1.25, 64: 1.6}
B16 = {0: 0.55, 4: 1.0, 8: 1.1, 16: 1.2, 32: 1.5, 64: 2.2}
B64 = {0: 0.64, 4: 1.17, 8: 1.32, 16: 1.5, 32: 2.0, 64: 3.0}
GREEDY = dict(skill_mean=2.0, persistence=0.9, round_noise=1.0)
SAMPLED = dict(persistence=0.3, round_noise=1.0)
SCENARIOS = (
    Scenario("batch 1, greedy-like", 1, B1, **GREEDY),
    Scenario("batch 1, sampled-like", 1, B1, skill_mean=0.0, **SAMPLED),
    Scenario("batch 4, sampled-like", 4, B4, skill_mean=0.8, **SAMPLED),
    Scenario("batch 16, greedy-like", 16, B16, **GREEDY),
    Scenario("batch 64, greedy-like", 64, B64, **{**GREEDY, "skill_mean": 2.5}),
    Scenario("batch 64, sampled-like", 64, B64, skill_mean=0.5, **SAMPLED),
)


COSTS_BY_BATCH = {1: B1, 4: B4, 16: B16, 64: B64}


def trace_scenarios(
    path,
    costs_by_batch: dict[int, dict[int, float]] | None = None,
    chain: int | None = None,
    bench_prompts: int | None = None,
) -> tuple[Scenario, ...]:
    """Batch 1, 4, 16 and 64 (or the batches of costs_by_batch) at temperature 0 and 1 replaying the
    recorded traces, with the cost tables above or costs_by_batch (costs_from_bench). chain: DFlash's
    chain of that many nodes among the buckets where the traces hold its counts (greedy), costing what
    its run measured or else what bucket 16 costs (the same drafter, a verify of one token less).
    bench_prompts: the requests as `bench e2e --prompts bench_prompts` makes them (Scenario)."""
    out = []
    for temperature in ("0", "1"):
        traces = load_traces(path, temperature)
        with_chain = chain is not None and all(t.chain_counts is not None for t in traces)
        buckets = auto_buckets(chain) if with_chain else AUTO_BUCKETS
        for batch, costs in (costs_by_batch or COSTS_BY_BATCH).items():
            name = f"batch {batch}, kimi-nano traces, temperature {temperature}"
            if with_chain:
                costs = {**costs, chain: costs.get(chain, costs[16])}
                name += f", chain {chain}"
            if bench_prompts:
                name += f", the bench's {bench_prompts} prompts"
            out.append(Scenario(name, batch, costs, traces=traces, buckets=buckets,
                                bench_prompts=bench_prompts, greedy=temperature == "0"))  # fmt: skip
    return tuple(out)


def costs_from_bench(path, temperature: float = 0.0) -> dict[int, dict[int, float]]:
    """The round costs a GPU run measured (ms per bucket of AUTO_BUCKETS, and of DFlash's chain where
    measured), per batch, from a `bench e2e --target nano --auto` result (e2e_nano.json): a tree
    bucket's (and the chain's) from its fixed budget's row (the mean of its measured rounds: every
    round of it, where the auto row's policy holds the median of the last rounds it picked, which for a
    bucket seldom picked can be old; the step: plain decoding's), else the auto row's, else the
    nearest smaller tree bucket's. ValueError naming `path`
    where a batch has none of these for a tree bucket or the step."""
    rows = json.loads(Path(path).read_text())["rows"]
    out: dict[int, dict[int, float]] = {}
    for r in rows:
        if r.get("temperature") != temperature:
            continue
        costs = out.setdefault(int(r["batch"]), {})
        budget = 0 if r["method"] == "autoregressive" else r["budget"]
        if budget == "auto":
            for k, b in (r.get("budget_report") or {}).items():
                if b["seconds"] == b["seconds"] and int(k) not in costs:
                    costs[int(k)] = b["seconds"] * 1e3
        elif isinstance(budget, int) and r.get("round_costs"):  # a fixed budget, AR (0) or DFlash (L)
            measured = r["round_costs"]
            if measured["measured"]:
                costs[budget] = measured["seconds"] / measured["measured"] * 1e3
    for batch, costs in out.items():
        for k in AUTO_BUCKETS:
            smaller = [j for j in AUTO_BUCKETS if 0 < j < k and j in costs]
            larger = [j for j in AUTO_BUCKETS if j > k and j in costs]
            if k not in costs and k > 0 and (smaller or larger):
                costs[k] = costs[smaller[-1]] if smaller else costs[larger[0]]
        if any(k not in costs for k in AUTO_BUCKETS):
            raise ValueError(f"{path}: no cost for buckets {[k for k in AUTO_BUCKETS if k not in costs]} "
                             f"at batch {batch}, temperature {temperature:g}")  # fmt: skip
        out[batch] = dict(sorted(costs.items()))
    return dict(sorted(out.items()))


def compare(sc: Scenario, calls: int = 3, seeds: int = 8, static: bool = True) -> dict:
    """Tokens per second of autoregressive decoding, every fixed bucket and auto on the same requests:
    per setting, `seeds` groups of `calls` calls on one policy (as a Runner keeps its costs and
    calibration), the last call of each group timed; with bench prompts, group s replays the bench's
    call s modulo bench_groups (each of its Runners learns on its own prompts)."""
    total = sc.batch * sc.tokens
    groups = bench_groups(sc)
    rates: dict[str, float] = {}
    for k in sc.buckets:
        t = sum(run_call(sc, 1000 * s + calls - 1, k, group=s % groups)["seconds"] for s in range(seeds))
        rates["autoregressive" if k == 0 else f"bucket {k}"] = seeds * total / t
    t, picks = 0.0, []
    for s in range(seeds):
        policy = BudgetPolicy(
            sc.buckets, STEP_ROUNDS * BLOCK, refresh_rounds=REFRESH_ROUNDS, defer_refresh=True
        )
        for c in range(calls):
            policy.new_call(copies(sc, s % groups))
            out = run_call(sc, 1000 * s + c, None, policy, static, group=s % groups)
        t += out["seconds"]
        picks += out["picks"]
    rates["auto"] = seeds * total / t
    best = max((v, k) for k, v in rates.items() if k != "auto")
    hist = {k: picks.count(k) for k in sc.buckets if picks.count(k)}
    return {"rates": rates, "best": best[1], "auto_over_best": rates["auto"] / best[0],
            "auto_over_ar": rates["auto"] / rates["autoregressive"], "picks": hist}  # fmt: skip
