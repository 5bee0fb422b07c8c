"""Where the host's time per decoding round goes: kimi-nano (bf16 on CUDA, float32 on the CPU) on a
Runner, the third call timed (the first compiles and captures, the second times stages, as bench e2e
does), with the engine loop's host steps wrapped in timers: the wait for the round's copy (its event),
the read, the commit, the enqueue of a round (its graph replays), and with the auto budget the policy's
pick and observe. A wait near zero while the wall per round is more than the device's round means the
host is the bottleneck. `--timeline` also lays the timed call out in time: the prefill, the time to
the first round read, the rounds, and the longest host steps with the round they belong to, to find
what a call spends outside its rounds.

    python scripts/round_host_time.py [--batch 1 64] [--budgets 8 auto ar] [--temperature 0] [--timeline]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter, nano_prompts, prompt_batches
from kdtree_engine.engine import GenerationConfig, Runner, SamplingParams, loop
from kdtree_engine.engine import budget as budget_module
from kdtree_engine.engine.tokenizer import load_tokenizer
from kdtree_engine.model import load_model

STEPS = [  # (owner, attribute, label): the host steps of a round
    (torch.cuda.Event, "synchronize", "wait"),
    (loop._HostCopy, "read", "copy read (wait included)"),
    (loop._Rounds, "pick", "pick"),
    (budget_module.BudgetPolicy, "observe", "observe"),
    (loop, "_commit", "commit"),
    (loop._Rounds, "enqueue", "enqueue"),
    (loop._Rounds, "capture", "capture"),
    (loop, "_prefill", "prefill"),
]


def wrap_steps(seconds: dict[str, float], events: list[tuple[str, float, float]]) -> None:
    """Adds each step's host seconds to seconds[label] and appends (label, start, seconds) to events
    (the wrapped functions stay in place)."""
    for owner, name, label in STEPS:
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                seconds[_label] += dt
                events.append((_label, t0, dt))

        setattr(owner, name, timed)


def timeline(events: list[tuple[str, float, float]], start: float, wall: float, longest: int = 8) -> str:
    """The timed call in time: its prefill, when the first round was read, how long the reads took
    from there, and its `longest` host steps (their round: the reads before them)."""
    events = sorted(events, key=lambda e: e[1])
    reads = [t + dt - start for label, t, dt in events if label == "copy read (wait included)"]
    prefill = sum(dt for label, _, dt in events if label == "prefill")
    lines = [
        f"  call {wall * 1e3:.2f} ms: prefill {prefill * 1e3:.2f} ms, first read at {reads[0] * 1e3:.2f} ms, "
        f"last read at {reads[-1] * 1e3:.2f} ms, {len(reads)} reads"
    ]
    top = sorted((e for e in events if e[0] != "wait"), key=lambda e: -e[2])[:longest]  # a wait is in a read
    for label, t, dt in top:
        before = sum(r <= t - start for r in reads)
        lines.append(f"  {label}: {dt * 1e3:.3f} ms at {(t - start) * 1e3:.2f} ms (round {before})")
    return "\n".join(lines)


def bucket_costs(stats) -> str:
    """The auto budget's measured round costs in a call, per bucket: median ms (rounds measured)."""
    by_bucket = defaultdict(list)
    for bucket, seconds in zip(stats.budgets, stats.round_seconds, strict=False):
        if seconds == seconds:
            by_bucket[bucket].append(seconds)
    medians = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in sorted(by_bucket.items())}
    return ", ".join(f"{k}: {ms:.3f} ({len(by_bucket[k])})" for k, ms in medians.items())


def budget_arg(text: str) -> int | str:
    """A budget, "auto", or "ar" (plain autoregressive decoding)."""
    return text if text in ("auto", "ar") else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--budgets", type=budget_arg, nargs="+", default=[8, "auto"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--timeline", action="store_true", help="lay the timed call out in time")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(KIMI_NANO, dtype=dtype, device=device)
    drafter, _ = nano_drafter(drafter_path(None), target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    seconds: dict[str, float] = defaultdict(float)
    events: list[tuple[str, float, float]] = []
    wrap_steps(seconds, events)
    prompts = nano_prompts(8)
    for batch in args.batch:
        group = prompt_batches(prompts, batch)[0]
        for budget in args.budgets:
            method = "autoregressive" if budget == "ar" else "ddtree"
            config = GenerationConfig(method=method, budget=32 if budget == "ar" else budget, seed=0,
                                      max_new_tokens=args.new_tokens,
                                      sampling=SamplingParams(temperature=args.temperature))  # fmt: skip
            runner = Runner(target, drafter, config, batch_size=batch, prompt_len=max(map(len, group)))
            runner.generate(group)
            staged = runner.generate(group, stage_timing=True).stats
            seconds.clear()
            events.clear()
            start = time.perf_counter()
            stats = runner.generate(group, stage_timing=False).stats
            steps = ", ".join(f"{k} {v / stats.rounds * 1e3:.3f}" for k, v in seconds.items())
            print(f"batch {batch} budget {budget}: {stats.rounds} rounds, wall per round "
                  f"{stats.wall_time / stats.rounds * 1e3:.3f} ms; host ms per round: {steps}")  # fmt: skip
            if args.timeline:
                print(timeline(events, start, stats.wall_time))
                for name, st in (("stage-timed call", staged), ("timed call", stats)):
                    print(f"  {name}: the policy's measured ms per bucket: {bucket_costs(st)}")


if __name__ == "__main__":
    main()
