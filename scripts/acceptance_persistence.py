"""How much a draft's path-probability sum tells about acceptance, now and two rounds later: the
question behind the auto budget's estimator (engine/budget.py), whose choice of round k + 1 sees the
sums of round k - 1 (rounds are pipelined). Runs the shipped kimi-nano pair on the CPU (float32) over
held-out prompts with the auto budget held at one bucket, and prints, per bucket, the mean S, the mean
committed tokens, the correlation of S with the same round's committed tokens and with those of the
round two later (same request).

    python scripts/acceptance_persistence.py [--temperature 0] [--bucket 64] [--prompts 8]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter, nano_prompts
from kdtree_engine.engine import GenerationConfig, SamplingParams, generate
from kdtree_engine.engine.budget import AUTO_BUCKETS, BudgetPolicy
from kdtree_engine.engine.tokenizer import load_tokenizer
from kdtree_engine.model import load_model


def rounds_of(target, drafter, prompt: list[int], config: GenerationConfig, bucket: int) -> list[tuple]:
    """(committed tokens, S at every bucket) of each speculative round of one request."""
    out: list[tuple] = []
    observe, pick = BudgetPolicy.observe, BudgetPolicy.pick

    def held(self, active, must_draft, remaining=None):
        pick(self, active, must_draft, remaining)  # the policy's bookkeeping, then the one bucket
        return bucket

    def recorded(self, bucket, seconds, rows, counts, sums):
        if sums is not None:
            out.append((counts[0], np.asarray(sums)[0]))
        return observe(self, bucket, seconds, rows, counts, sums)

    BudgetPolicy.pick, BudgetPolicy.observe = held, recorded
    try:
        generate(target, drafter, [prompt], config)
    finally:
        BudgetPolicy.pick, BudgetPolicy.observe = pick, observe
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--bucket", type=int, choices=[k for k in AUTO_BUCKETS if k], default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_model(KIMI_NANO, dtype=torch.float32, device=torch.device("cpu"))
    drafter, _ = nano_drafter(drafter_path(None), target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    config = GenerationConfig(budget="auto", max_new_tokens=args.new_tokens, seed=0,
                              sampling=SamplingParams(temperature=args.temperature))  # fmt: skip
    runs = [rounds_of(target, drafter, p, config, args.bucket) for p in nano_prompts(args.prompts)]
    print(f"kimi-nano, CPU float32, bucket {args.bucket}, temperature {args.temperature:g}, "
          f"{args.prompts} prompts, {sum(map(len, runs))} speculative rounds")  # fmt: skip
    print("| bucket | mean S | mean committed | corr(S, same round) | corr(S, two rounds later) |")
    print("|---|---|---|---|---|")
    for j, k in enumerate(AUTO_BUCKETS):
        if not 0 < k <= args.bucket:
            continue
        now = [(s[j], c) for r in runs for c, s in r]
        later = [(r[t - 2][1][j], r[t][0]) for r in runs for t in range(2, len(r))]
        s, c = np.array(now).T
        print(f"| {k} | {s.mean():.2f} | {c.mean():.2f} | {np.corrcoef(s, c)[0, 1]:.2f} | "
              f"{np.corrcoef(*np.array(later).T)[0, 1]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
