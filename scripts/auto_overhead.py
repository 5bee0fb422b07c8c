"""What the auto budget's machinery costs apart from its choices: kimi-nano (bf16 on CUDA, float32 on the
CPU) on a Runner per setting, greedy, each call's wall time (the median of `--calls` calls after a
call that compiles and captures and one more), for a fixed budget k and for budget "auto" made to pick
k every round, with its policy's host work (pick and observe) kept, and without it (pick returns k at
once, observe does nothing), then auto itself. Where auto picking k costs more than budget k, the
difference is the machinery (its graphs, the wider copy, the policy's host work), not the choice; the
measured rounds' sum (stats.round_seconds) against the call tells how much of a call lies outside them,
and a stage-timed call each stage's time per round (the report runs in the accept stage).

    python scripts/auto_overhead.py [--batch 1 4 16] [--budgets 16 32] [--calls 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter, nano_prompts, prompt_batches
from kdtree_engine.engine import GenerationConfig, Runner, SamplingParams
from kdtree_engine.engine.budget import BudgetPolicy
from kdtree_engine.engine.tokenizer import load_tokenizer
from kdtree_engine.model import load_model

REAL_PICK, REAL_OBSERVE = BudgetPolicy.pick, BudgetPolicy.observe


def script_policy(bucket: int | None, host_work: bool) -> None:
    """BudgetPolicy made to pick `bucket` every round (None: the real policy), with its own pick and
    observe run first (host_work) or skipped."""
    if bucket is None:
        BudgetPolicy.pick, BudgetPolicy.observe = REAL_PICK, REAL_OBSERVE
        return

    def pick(self, active, must_draft, remaining=None):
        if host_work:
            REAL_PICK(self, active, must_draft, remaining)
        return bucket

    BudgetPolicy.pick = pick
    BudgetPolicy.observe = REAL_OBSERVE if host_work else (lambda self, *args, **kwargs: None)


def measure(target, drafter, group, budget, calls: int, new_tokens: int) -> dict:
    """Median call ms, rounds, and the measured rounds' ms of `calls` calls on a fresh Runner."""
    config = GenerationConfig(method="ddtree", budget=budget, seed=0, max_new_tokens=new_tokens,
                              sampling=SamplingParams(temperature=0.0))  # fmt: skip
    runner = Runner(target, drafter, config, batch_size=len(group), prompt_len=max(map(len, group)))
    runner.generate(group)
    staged = runner.generate(group, stage_timing=True).stats  # each stage's time per round
    stages = {k: v / staged.rounds * 1e3 for k, v in staged.stage_times.items() if k != "prefill"}
    walls, rounds, measured = [], [], []
    for _ in range(calls):
        stats = runner.generate(group).stats
        walls.append((stats.wall_time - stats.capture_time) * 1e3)
        rounds.append(stats.rounds)
        measured.append(sum(s for s in stats.round_seconds if s == s) * 1e3)
    return {"call": statistics.median(walls), "rounds": statistics.median(rounds),
            "measured": statistics.median(measured), "stages": stages}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(KIMI_NANO, dtype=dtype, device=device)
    drafter, _ = nano_drafter(drafter_path(None), target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    prompts = nano_prompts(8)
    print(
        "| batch | run | call ms | rounds | measured rounds ms | rest ms | stage ms per round (stage-timed) |"
    )
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        group = prompt_batches(prompts, batch)[0]
        settings = [(f"budget {k}", k, None, True) for k in args.budgets]
        settings += [(f"auto picking {k}", "auto", k, True) for k in args.budgets]
        settings += [(f"auto picking {k}, no policy host work", "auto", k, False) for k in args.budgets]
        settings += [("auto", "auto", None, True)]
        for name, budget, bucket, host_work in settings:
            script_policy(bucket, host_work)
            r = measure(target, drafter, group, budget, args.calls, args.new_tokens)
            stages = ", ".join(f"{k} {v:.3f}" for k, v in r["stages"].items())
            print(f"| {batch} | {name} | {r['call']:.2f} | {r['rounds']:.0f} | {r['measured']:.2f} | "
                  f"{r['call'] - r['measured']:.2f} | {stages} |", flush=True)  # fmt: skip
        script_policy(None, True)


if __name__ == "__main__":
    main()
