"""An autoregressive step in plain decoding's Runner against the same step in the auto budget's Runner,
on kimi-nano (bf16 on CUDA, float32 on the CPU), to tell a real difference from drift between the
bench's rows (issue 28: at batch 64, temperature 1, auto gives every call to steps, yet its rounds
cost a few percent more than plain decoding's in `bench e2e`, where the autoregressive row runs first
and auto last).

Both Runners are warmed as `bench e2e` warms them (a call that captures, a stage-timed call); then
their timed calls alternate, AR then auto, so that both see the same state of the device. Per Runner:
the median call (ms, capture excluded), the median round and step (ms, each round read's host-clock
interval), the rounds, and why auto picked its rounds. With `--profile` (CUDA), one more call of each
under torch.profiler: each kernel's launches and device time per call, the kernels that differ first.

    python scripts/step_cost_ab.py [--batch 64] [--temperature 1] [--calls 6] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.bench import e2e
from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter, nano_prompts, prompt_batches
from kdtree_engine.bench.timing import kernel_profile
from kdtree_engine.engine import GenerationConfig, Runner, SamplingParams
from kdtree_engine.engine.tokenizer import load_tokenizer
from kdtree_engine.model import load_model


def call_figures(stats) -> dict[str, float]:
    """One call's ms (capture excluded), median round and median step ms (NaN rounds dropped)."""
    rounds = [s for s in stats.round_seconds if s == s]
    buckets = stats.budgets or [0] * len(stats.round_seconds)
    steps = [s for k, s in zip(buckets, stats.round_seconds, strict=False) if k == 0 and s == s]
    median = statistics.median
    return {
        "call_ms": (stats.wall_time - stats.capture_time) * 1e3,
        "round_ms": median(rounds) * 1e3 if rounds else float("nan"),
        "step_ms": median(steps) * 1e3 if steps else float("nan"),
        "rounds": stats.rounds,
        "steps": len(steps),
    }


def kernel_times(runner: Runner, group: list[list[int]]) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, device us)} of one untimed call under torch.profiler (CUDA)."""
    prof = kernel_profile(lambda: runner.generate(group, stage_timing=False))
    out = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if device_us > 0:
            out[event.key] = (event.count, float(device_us))
    return out


def kernel_diff(ar: dict, auto: dict, top: int = 20) -> list[str]:
    """The kernels whose launches or device time differ most between the two calls, largest first."""
    names = set(ar) | set(auto)
    rows = []
    for name in names:
        (n0, t0), (n1, t1) = ar.get(name, (0, 0.0)), auto.get(name, (0, 0.0))
        rows.append((abs(t1 - t0), name, n0, t0, n1, t1))
    rows.sort(reverse=True)
    totals = [sum(t for _, t in kernels.values()) for kernels in (ar, auto)]
    lines = [f"  total device us: ar {totals[0]:.0f}, auto {totals[1]:.0f}"]
    for _, name, n0, t0, n1, t1 in rows[:top]:
        lines.append(f"  {name[:90]:90s} ar {n0:5d} x {t0:9.1f} us | auto {n1:5d} x {t1:9.1f} us")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--profile", action="store_true", help="a kernel profile of one call each (CUDA)")
    args = parser.parse_args()
    if min(args.batch, args.new_tokens, args.calls) < 1 or args.temperature < 0:
        parser.exit(2, "step_cost_ab: --batch, --new-tokens and --calls must be >= 1, --temperature >= 0\n")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(KIMI_NANO, dtype=dtype, device=device)
    drafter, _ = nano_drafter(drafter_path(None), target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    group = prompt_batches(nano_prompts(8), args.batch)[0]
    sampling = SamplingParams(temperature=args.temperature)
    runs = {}  # warmed as bench e2e warms its rows (a call that captures, a stage-timed call)
    for name, method, budget in (("ar", "autoregressive", None), ("auto", "ddtree", "auto")):
        config = GenerationConfig(method=method, budget=budget, seed=0, max_new_tokens=args.new_tokens,
                                  sampling=sampling)  # fmt: skip
        runs[name] = e2e.warmed(target, drafter if method != "autoregressive" else None, group, config)
    outs = dict(zip(runs, e2e.alternate_calls(list(runs.values()), args.calls)))
    figures = {name: [call_figures(out.stats) for out in calls] for name, calls in outs.items()}
    reasons = Counter(
        f"{k}:{pick[0]}" for out in outs["auto"] for k, pick in zip(out.stats.budgets, out.stats.budget_picks)
    )
    print(
        f"batch {args.batch}, temperature {args.temperature}, {args.calls} calls each, alternating; {device}"
    )
    for name, rows in figures.items():
        cells = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(f"  {name:4s} call {cells['call_ms']:.2f} ms, round {cells['round_ms']:.4f} ms, step "
              f"{cells['step_ms']:.4f} ms, rounds {cells['rounds']:.0f}, steps {cells['steps']:.0f}; calls: "
              + " ".join(f"{r['call_ms']:.2f}" for r in rows))  # fmt: skip
    print(f"  auto's rounds by bucket and reason: {dict(reasons)}")
    if args.profile and device.type == "cuda":
        print("kernels of one call each (torch.profiler, CUDA graphs replayed):")
        ar, auto = (kernel_times(runs[name].runner, group) for name in ("ar", "auto"))
        print("\n".join(kernel_diff(ar, auto)))


if __name__ == "__main__":
    main()
