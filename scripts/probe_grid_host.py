"""Where the host's time per round goes inside `bench e2e --target nano`'s grid itself (not a Runner
alone, as scripts/round_host_time.py measures it): one setting of the grid (its prompt groups, every
row's Runner warmed and timed in turn, as the bench does), the engine loop's host steps wrapped in
timers (round_host_time.STEPS) and Python's garbage collections timed, summed per row over its untimed
calls and given per round read. A row whose wall per round is well above its device round while its
wait is near zero is host-bound; garbage collections are where a heap grown by the grid shows up.
The auto row's measured round cost per bucket (its median over the untimed calls) tells whether its
cheap rounds (steps, small trees) cost what a fixed row's do or what the host's work per round does;
each row's tokens per request and round, beside its wall per round, splits its tokens per second into
what its rounds commit and what they cost.

    python scripts/probe_grid_host.py [--batch 4] [--temperature 0] [--budgets 32] [--prompts 8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_host_time import wrap_steps  # noqa: E402

from kdtree_engine.assets import KIMI_NANO  # noqa: E402
from kdtree_engine.bench import e2e_nano  # noqa: E402
from kdtree_engine.engine import Runner  # noqa: E402
from kdtree_engine.engine.tokenizer import load_tokenizer  # noqa: E402
from kdtree_engine.model import load_model  # noqa: E402


class Tally:
    """Host seconds per (row, step) over untimed calls, their rounds and wall time, and GC time."""

    def __init__(self) -> None:
        self.row: str | None = None  # the row whose untimed call runs now (None: a warm-up call)
        self.steps: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.rounds: dict[str, int] = defaultdict(int)
        self.wall: dict[str, float] = defaultdict(float)
        self.accepted: dict[str, list[int]] = defaultdict(list)  # tokens committed per request and round
        # the auto row's measured round seconds by bucket (stats.budgets, stats.round_seconds): whether its
        # cheap rounds (steps, small trees) cost what the fixed rows' do, or the host's work per round
        self.by_bucket: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.gc_start = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if self.row is None:
            return
        if phase == "start":
            self.gc_start = time.perf_counter()
        else:
            self.steps[self.row][f"gc gen{info['generation']}"] += time.perf_counter() - self.gc_start


def label(config) -> str:
    return "ar" if config.method == "autoregressive" else f"{config.method} {config.budget}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--budgets", type=int, nargs="+", default=[32])
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda")
    target = load_model(KIMI_NANO, dtype=torch.bfloat16, device=device)
    mask = load_tokenizer(KIMI_NANO).token_id("<|mask|>")
    drafter, _ = e2e_nano.nano_drafter(e2e_nano.drafter_path(None), target, mask)
    tally, seconds, events = Tally(), defaultdict(float), []
    wrap_steps(seconds, events)
    gc.callbacks.append(tally.on_gc)
    inner = Runner.generate

    def generate(runner, prompts, *a, stage_timing: bool = False, **kw):
        timed = not stage_timing and runner in warmed_once
        warmed_once.add(runner)
        tally.row = label(runner.config) if timed else None
        seconds.clear()
        out = inner(runner, prompts, *a, stage_timing=stage_timing, **kw)
        if timed:
            for k, v in seconds.items():
                tally.steps[tally.row][k] += v
            tally.rounds[tally.row] += out.stats.rounds
            tally.wall[tally.row] += out.stats.wall_time - out.stats.capture_time
            tally.accepted[tally.row] += out.stats.accept_lengths
            for bucket, secs in zip(out.stats.budgets, out.stats.round_seconds, strict=False):
                if secs == secs:  # NaN: not measured
                    tally.by_bucket[tally.row][bucket].append(secs)
        tally.row = None
        return out

    warmed_once: set = set()
    Runner.generate = generate
    ns = argparse.Namespace(new_tokens=128, impl=None, eager=False, budgets=args.budgets, auto=True,
                            seed=0, row_invariant=False)  # fmt: skip
    groups = e2e_nano.prompt_batches(e2e_nano.nano_prompts(args.prompts), args.batch)
    rows, _ = e2e_nano.bench_setting(target, drafter, groups, args.batch, args.temperature, ns)
    print(f"batch {args.batch}, temperature {args.temperature:g}, {len(groups)} groups: host ms per round "
          "read in the untimed calls")  # fmt: skip
    for r in rows:
        print(f"  row {r['method']} {r['budget']}: {r['tokens_per_s']:.0f} tokens/s")
    for key, n in tally.rounds.items():
        steps = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in sorted(tally.steps[key].items()))
        accepted = tally.accepted[key]
        per_round = sum(accepted) / len(accepted) if accepted else 1.0  # none: autoregressive steps
        print(f"  {key}: {n} rounds, wall per round {tally.wall[key] / n * 1e3:.3f}, tokens per request and "
              f"round {per_round:.2f}; {steps}")  # fmt: skip
        if tally.by_bucket[key]:
            costs = ", ".join(f"{k}: {statistics.median(v) * 1e3:.3f} ({len(v)})"
                              for k, v in sorted(tally.by_bucket[key].items()))  # fmt: skip
            print(f"    {key}: measured ms per round by bucket, median (rounds): {costs}")


if __name__ == "__main__":
    main()
