"""Records kimi-nano's acceptance at every auto-budget bucket, round by round, for the policy simulator
(kdtree_engine.bench.auto_sim, trace settings): the shipped pair (on the CPU in float32 by default; on a
GPU in bf16 with `--device cuda --dtype bfloat16`, rounds run eagerly, the acceptance `bench e2e`
measures there) decodes held-out prompts with every round at the largest bucket, and per request and
round the script keeps the committed tokens a tree of each bucket would have given (the first k nodes of
a best-first tree are the tree of bucket k, and the accepted path's node indices grow along it, so its
nodes up to k are what that tree accepts; the target's token at each node is the same) and the draft's
sums S at each bucket; greedy, also what DFlash's chain would have committed (from the chain's nodes in
the same tree).

    python scripts/record_acceptance_traces.py [--prompts 16] [--new-tokens 128] [--out out/traces.json]
        [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.bench.auto_sim import chain_count, counts_at_buckets
from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter, nano_prompts
from kdtree_engine.engine import GenerationConfig, SamplingParams, generate, loop, stages
from kdtree_engine.engine.budget import AUTO_BUCKETS, BudgetPolicy
from kdtree_engine.engine.tokenizer import load_tokenizer
from kdtree_engine.model import load_model

TOP = AUTO_BUCKETS[-1]


def record(target, drafter, prompts: list[list[int]], config: GenerationConfig) -> list[list[dict]]:
    """Per request, its rounds: {"counts": tokens per bucket, "sums": S per bucket} at AUTO_BUCKETS (the
    round's report, engine.budget.round_report, less the chain's column where the drafter has one); at
    temperature 0 with a drafter that has a chain bucket, also {"chain": {"count", "censored", "sum"}}:
    what the chain would have committed on the round (auto_sim.chain_count) and its S."""
    traces: list[list[dict]] = [[] for _ in prompts]
    pick, accept, choose, report = (
        BudgetPolicy.pick,
        stages.Stages.accept,
        stages.Stages._choose,
        stages.round_report,
    )
    last: dict = {}

    def largest(self, active, must_draft, remaining=None):
        pick(self, active, must_draft, remaining)  # the policy's bookkeeping, then the largest bucket
        return TOP

    def kept(self, tree, logits):
        last["accept"] = choose(self, tree, logits)
        last["targets"] = logits.argmax(dim=-1)  # the greedy target's token at each node
        return last["accept"]

    def reported(*args, **kwargs):
        last["report"] = report(*args, **kwargs)
        return last["report"]

    def recorded(self, n):
        active = self.s.active.tolist()
        accept(self, n)
        columns = [self.buckets.index(k) for k in AUTO_BUCKETS]
        sums = last["report"][:, columns].tolist()
        chain = self.chain is not None and config.sampling.greedy
        if chain:
            tree, top1 = self.trees[n], self.topk[n][1][..., 0].cpu().numpy()
            chain_sums = last["report"][:, self.buckets.index(self.chain)].tolist()
        for b, on in enumerate(active):
            if on:
                counts = counts_at_buckets(last["accept"].accepted[b].cpu().numpy())
                traces[b].append({"counts": counts, "sums": sums[b]})
                if chain:  # what the chain would have committed, from the same round's nodes
                    count, censored = chain_count(tree.parents[b].cpu().numpy(), tree.tokens[b].cpu().numpy(),
                                                  last["targets"][b].cpu().numpy(), top1[b])  # fmt: skip
                    traces[b][-1]["chain"] = {"count": count, "censored": censored, "sum": chain_sums[b]}

    pipelined = loop._pipelined
    BudgetPolicy.pick, stages.Stages.accept, stages.Stages._choose = largest, recorded, kept
    # rounds one at a time on a GPU too: a round enqueued ahead of the last read would be recorded past
    # its requests' ends
    stages.round_report, loop._pipelined = reported, lambda run, device: False
    try:
        generate(target, drafter, prompts, config)
    finally:
        BudgetPolicy.pick, stages.Stages.accept, stages.Stages._choose = pick, accept, choose
        stages.round_report, loop._pipelined = report, pipelined
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--out", type=Path, default=Path("out/traces.json"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    target = load_model(KIMI_NANO, dtype=getattr(torch, args.dtype), device=torch.device(args.device))
    drafter, _ = nano_drafter(drafter_path(None), target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    prompts = nano_prompts(args.prompts)
    out = {"buckets": list(AUTO_BUCKETS), "new_tokens": args.new_tokens, "temperatures": {}}
    for temperature in args.temperatures:
        config = GenerationConfig(budget="auto", max_new_tokens=args.new_tokens, seed=0, cuda_graphs=False,
                                  sampling=SamplingParams(temperature=temperature))  # fmt: skip
        traces = record(target, drafter, prompts, config)
        out["temperatures"][f"{temperature:g}"] = traces
        mean = np.mean([r["counts"] for t in traces for r in t], axis=0)
        print(f"temperature {temperature:g}: {sum(map(len, traces))} rounds; mean committed per bucket "
              + " ".join(f"{k}:{m:.2f}" for k, m in zip(AUTO_BUCKETS, mean)))  # fmt: skip
        chains = [r["chain"] for t in traces for r in t if "chain" in r]
        if chains:
            count, censored = np.mean([c["count"] for c in chains]), np.mean([c["censored"] for c in chains])
            print(
                f"  the chain: mean committed {count:.2f}, censored {censored:.3f} of rounds (a lower bound)"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
