"""Where the host's time per decoding round goes: kimi-nano (bf16 on CUDA, float32 on the CPU) on a
Runner, the third call timed (the first compiles and captures, the second times stages, as bench e2e
does), with the engine loop's host steps wrapped in timers: the wait for the round's copy (its event),
the read, the commit, the enqueue of a round (its graph replays), and with the auto budget the policy's
pick and observe. A wait near zero while the wall per round is more than the device's round means the
host is the bottleneck.

    python scripts/round_host_time.py [--batch 1 64] [--budgets 8 auto] [--temperature 0]
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
]


def wrap_steps(seconds: dict[str, float]) -> None:
    """Adds each step's host seconds to seconds[label] (the wrapped functions stay in place)."""
    for owner, name, label in STEPS:
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def budget_arg(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--budgets", type=budget_arg, nargs="+", default=[8, "auto"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(KIMI_NANO, dtype=dtype, device=device)
    drafter, _ = nano_drafter(drafter_path(None), target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    seconds: dict[str, float] = defaultdict(float)
    wrap_steps(seconds)
    prompts = nano_prompts(8)
    for batch in args.batch:
        group = prompt_batches(prompts, batch)[0]
        for budget in args.budgets:
            config = GenerationConfig(budget=budget, max_new_tokens=args.new_tokens, seed=0,
                                      sampling=SamplingParams(temperature=args.temperature))  # fmt: skip
            runner = Runner(target, drafter, config, batch_size=batch, prompt_len=max(map(len, group)))
            runner.generate(group)
            runner.generate(group, stage_timing=True)
            seconds.clear()
            stats = runner.generate(group, stage_timing=False).stats
            steps = ", ".join(f"{k} {v / stats.rounds * 1e3:.3f}" for k, v in seconds.items())
            print(f"batch {batch} budget {budget}: {stats.rounds} rounds, wall per round "
                  f"{stats.wall_time / stats.rounds * 1e3:.3f} ms; host ms per round: {steps}")  # fmt: skip


if __name__ == "__main__":
    main()
