"""The host's own work per decoding round, without a model: the engine loop's host steps (the copy
read, the commit of the round's tokens to the requests, and with the auto budget the policy's observe,
the smaller trees' counts included, and pick) driven with synthetic rounds of random committed counts
and tokens, timed in a tight loop.

On a GPU machine the host does nothing else between rounds but replay graphs, so these steps' cost is
what it adds to a round when the host is the bottleneck (`scripts/round_host_time.py` measures them
inside real runs on the GPU). On the CPU, timing them inside real runs measures mostly the torch
computation just before them (the first Python operations after a forward run many times slower), so
this script isolates them. The policy defers its refreshes as the engine's does
(BudgetPolicy.defer_refresh): `refresh` is the time the engine spends on them after it enqueues the next
round, beside the device's rounds, and the other steps are what lies between a round's read and the
next enqueue; `p90 path` is the 90th percentile of that path per round (a refresh done inside observe
lands there every REFRESH_ROUNDS rounds).

    python scripts/host_round_cost.py [--batch 1 16 64] [--rounds 2000] [--slots 16]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

from kdtree_engine.bench.plot import markdown_table
from kdtree_engine.engine import loop
from kdtree_engine.engine.budget import AUTO_BUCKETS, REFRESH_ROUNDS, BudgetPolicy
from kdtree_engine.engine.budget_estimates import MIN_COST_ROUNDS
from kdtree_engine.engine.requests import Requests
from kdtree_engine.engine.stats import GenerationStats


def timed_rounds(batch: int, rounds: int, slots: int, auto: bool, new_tokens: int = 128,
                 seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Microseconds per round of each host step, over `rounds` synthetic rounds at `batch` requests, in
    calls of `new_tokens` tokens per request (a static call: with the auto budget the policy's static
    call's test runs, every bucket's cost measured before the first timed round, as after a Runner's
    first call)."""
    rng = np.random.default_rng(seed)
    nb = len(AUTO_BUCKETS)
    sums = 2 * nb if auto else 0  # the bucket sums, then the counts each smaller tree would have committed
    committed = torch.zeros(batch, 1 + slots + sums, dtype=torch.int64)
    state = SimpleNamespace(committed=committed, active=torch.ones(batch, dtype=torch.bool))
    stats = GenerationStats(method="ddtree", batch_size=batch)
    policy = (
        BudgetPolicy(AUTO_BUCKETS, slots, refresh_rounds=REFRESH_ROUNDS, defer_refresh=True) if auto else None
    )
    if policy is not None:
        for k in AUTO_BUCKETS:
            for _ in range(MIN_COST_ROUNDS):
                policy.costs.observe(k, 1e-3 * (1 + k / 64))
    seconds = dict.fromkeys(("read", "commit", "pick", "observe", "refresh"), 0.0)
    paths = []
    bucket, done = AUTO_BUCKETS[-1], 0
    while done < rounds:
        reqs = Requests([new_tokens] * batch, frozenset({0}), None)
        run = SimpleNamespace(reqs=reqs, stats=stats, config=SimpleNamespace(method="ddtree"))
        host = loop._HostCopy(state)
        if policy is not None:
            policy.new_call()
        first = True
        while reqs.running() and done < rounds:
            counts = rng.integers(1, 4, batch)
            committed[:, 0] = torch.from_numpy(counts)
            committed[:, 1 : 1 + slots] = torch.from_numpy(rng.integers(1, 1000, (batch, slots)))
            if auto:  # every tree bucket told (the round is bucket 64's), no count above the round's own
                would = np.minimum(counts[:, None], rng.integers(1, 4, (batch, nb))).astype(np.float64)
                would[:, AUTO_BUCKETS.index(0)] = np.nan
                floats = np.concatenate([rng.random((batch, nb)) * 3, would], axis=1)
                committed[:, 1 + slots :] = torch.from_numpy(floats).view(torch.int64)
            host.send(state)
            tr = time.perf_counter()
            if policy is not None:
                policy.refresh_when_due(run.reqs.active)
            t0 = time.perf_counter()
            seconds["refresh"] += t0 - tr
            tokens, counts, floats = host.read(sums)
            t1 = time.perf_counter()
            if policy is not None and not first:
                rows = np.flatnonzero(np.asarray(run.reqs.active))
                told = (floats[:, :nb], floats[:, nb:]) if bucket else (None, None)
                policy.observe(bucket, 1e-3 * (1 + bucket / 64), rows, counts, *told)
            t2 = time.perf_counter()
            loop._commit(run, state, tokens, counts)
            t3 = time.perf_counter()
            if policy is not None and reqs.running():
                bucket = policy.pick(run.reqs.active, first, reqs.limits - reqs.lengths)
            t4 = time.perf_counter()
            first, done = False, done + 1
            for key, dt in (("read", t1 - t0), ("observe", t2 - t1), ("commit", t3 - t2), ("pick", t4 - t3)):
                seconds[key] += dt
            paths.append(t4 - t0)
    out = {k: v / rounds * 1e6 for k, v in seconds.items()}
    out["p90 path"] = float(np.percentile(paths, 90)) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--slots", type=int, default=16, help="token slots per round (the drafter's L + 1)")
    args = parser.parse_args()
    steps = ("read", "commit", "observe", "pick")
    rows = []
    for batch in args.batch:
        for auto in (False, True):
            t = timed_rounds(batch, args.rounds, args.slots, auto)
            path = sum(t[k] for k in steps)
            rows.append([batch, "auto" if auto else "fixed", *(t[k] for k in steps), path, t["p90 path"],
                         t["refresh"]])  # fmt: skip
    heads = ["batch", "budget", *steps, "path (us per round)", "p90 path", "refresh (beside the device)"]
    print(markdown_table(heads, rows))


if __name__ == "__main__":
    main()
