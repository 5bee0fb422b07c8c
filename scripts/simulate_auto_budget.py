"""The auto budget's policy on simulated static batches (kdtree_engine.bench.auto_sim): per setting,
tokens per second of autoregressive decoding, every fixed bucket and auto on the same requests, auto
against the best of them, and the buckets auto picked. A model of rounds, not a measurement: it
checks the policy's logic on the CPU.

    python scripts/simulate_auto_budget.py [--seeds 16] [--refilled] [--traces out/traces.json]
        [--costs out/nano_auto/e2e_nano.json] [--chain 15] [--bench-prompts 8]

--refilled runs the policy as for a batch whose finished rows are refilled (it is not told the tokens
each request has left, so it has no static call's test): the rule alone. --traces replays kimi-nano's
recorded acceptance (scripts/record_acceptance_traces.py) at batch 1, 4, 16 and 64, temperature 0
and 1, instead of the model's settings; --costs takes their round costs from a GPU run of `bench e2e
--target nano --auto` (auto_sim.costs_from_bench: the policy's own median per bucket, at temperature
0), in place of the illustrative tables; --chain 15 adds DFlash's chain of 15 nodes to the buckets where
the traces hold its counts (temperature 0; record_acceptance_traces.py records them); --bench-prompts 8
makes the requests as `bench e2e --prompts 8` does (the first 8 traces, recorded from the held-out
prompts in order, cycled over the batch, each from its first token, the same in every call) in place
of random traces from random text positions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kdtree_engine.bench.auto_sim import SCENARIOS, compare, costs_from_bench, trace_scenarios
from kdtree_engine.bench.plot import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=16, help="groups of 3 calls per setting")
    parser.add_argument("--refilled", action="store_true", help="no static call's test (the rule alone)")
    parser.add_argument(
        "--traces", type=Path, help="recorded acceptance to replay (record_acceptance_traces.py)"
    )
    parser.add_argument("--costs", type=Path, help="a bench e2e --target nano --auto result (e2e_nano.json)")
    parser.add_argument(
        "--chain", type=int, help="DFlash's chain of this many nodes among the buckets (greedy traces)"
    )
    parser.add_argument(
        "--bench-prompts", type=int, help="requests as bench e2e --prompts N makes them (with --traces)"
    )
    args = parser.parse_args()
    if (args.costs or args.chain or args.bench_prompts) and not args.traces:
        parser.error("--costs, --chain and --bench-prompts need --traces")
    if args.bench_prompts is not None and args.bench_prompts < 1:
        parser.error(f"--bench-prompts: expected at least 1, got {args.bench_prompts}")
    costs = costs_from_bench(args.costs) if args.costs else None
    rows = []
    scenarios = (
        trace_scenarios(args.traces, costs, args.chain, args.bench_prompts) if args.traces else SCENARIOS
    )
    for sc in scenarios:
        r = compare(sc, seeds=args.seeds, static=not args.refilled)
        rates = r["rates"]
        picks = " ".join(f"{k}:{n}" for k, n in r["picks"].items())
        rows.append([sc.name, f"{rates['autoregressive']:.0f}", f"{rates[r['best']]:.0f} ({r['best']})",
                     f"{rates['auto']:.0f}", f"{r['auto_over_best']:.3f}", picks])  # fmt: skip
    heads = ["setting", "AR", "best fixed (which)", "auto", "auto / best", "auto's buckets (rounds)"]
    print(markdown_table(heads, rows))


if __name__ == "__main__":
    main()
