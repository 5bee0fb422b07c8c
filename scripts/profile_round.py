"""Where a DDTree round's time goes inside generate(): the shipped kimi-nano pair (or the scaled-down
Kimi shape with its stand-in drafter, --target small), one greedy generate() call per batch, profiled
with torch.profiler over its captured rounds. Prints, per round: the stage times of the engine's own
timer, the wall time, and the kernels (name, launches and GPU microseconds per round, sorted by time),
then the same table for an isolated verify forward of the same node count (bench/forward_cost's
forward_call, as bench e2e times it), so that what the engine's verify runs and the isolated forward
does not shows up line by line. Markdown to $OUT/profile_round.md when $OUT is set.

    python scripts/profile_round.py [--target nano|small] [--batch 1] [--budget 32] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kdtree_engine.bench.forward_cost import forward_call
from kdtree_engine.bench.timing import time_graph
from kdtree_engine.engine import GenerationConfig, generate


def load_pair(target: str, device: torch.device, new_tokens: int):
    """(target, drafter, prompts) for --target: kimi-nano with its trained drafter and held-out prompts,
    or the scaled-down Kimi shape with bench e2e's stand-in drafter and random 64-token prompts."""
    if target == "nano":
        from kdtree_engine.assets import KIMI_NANO
        from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter, nano_prompts
        from kdtree_engine.engine.tokenizer import load_tokenizer
        from kdtree_engine.model import load_model

        model = load_model(KIMI_NANO, dtype=torch.bfloat16, device=device)
        mask = load_tokenizer(KIMI_NANO).token_id("<|mask|>")
        drafter, _ = nano_drafter(drafter_path(None), model, mask)
        return model, drafter, nano_prompts(8)
    from kdtree_engine.bench.e2e_small import kimi_small_config, random_target
    from kdtree_engine.engine.demo import NoisyOracleDrafter

    model = random_target(kimi_small_config(), device)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (8, 64), generator=gen).tolist()
    ar = generate(model, None, prompts, GenerationConfig(method="autoregressive", max_new_tokens=new_tokens))
    horizon = [list(p) + t for p, t in zip(prompts, ar.tokens)]
    drafter = NoisyOracleDrafter(horizon, model.config.vocab_size, block_size=16, device=device)
    return model, drafter, prompts


def kernel_rows(events, per: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches per `per`, GPU us per `per`), by GPU time, from a profile's CUDA events."""
    count, total = collections.Counter(), collections.Counter()
    for e in events:
        count[e.name] += 1
        total[e.name] += e.device_time
    rows = [(name, count[name] / per, total[name] / per) for name in total]
    return sorted(rows, key=lambda r: -r[2])


@contextlib.contextmanager
def labelled_stages():
    """Each replay or eager run of a stage inside a profiler range named `stage:<name>`."""
    from kdtree_engine.engine import loop

    run = loop._Graphs.run

    def labelled(self, stage):
        with torch.profiler.record_function(f"stage:{stage.name}"):
            run(self, stage)

    loop._Graphs.run = labelled
    try:
        yield
    finally:
        loop._Graphs.run = run


def timeline(trace: dict) -> str:
    """Per captured stage (median over the replayed rounds): the host's cudaGraphLaunch time, the delay
    from the launch call to the stage's first kernel, the GPU span (first kernel start to last kernel
    end), the kernels' busy time inside it, the kernels; then the round: the host's wait for the
    round's copy and the host time from the end of that wait to the next round's first launch."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    stages = sorted((e for e in ev if str(e.get("name", "")).startswith("stage:")), key=lambda e: e["ts"])
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_corr = collections.defaultdict(list)
    for k in gpu:
        by_corr[k["args"].get("correlation")].append(k)
    per = collections.defaultdict(lambda: collections.defaultdict(list))
    for st in stages:
        t0, t1 = st["ts"], st["ts"] + st["dur"]
        calls = [r for r in runtime if t0 <= r["ts"] <= t1]
        launch = [r for r in calls if r["name"] == "cudaGraphLaunch"]
        if not launch:
            continue  # an eager stage (first round)
        ks = sorted(
            (k for r in calls for k in by_corr.get(r["args"].get("correlation"), [])), key=lambda k: k["ts"]
        )
        if not ks:
            continue
        d = per[st["name"][6:]]
        d["launch_us"].append(launch[0]["dur"])
        d["queue_us"].append(ks[0]["ts"] - launch[0]["ts"])
        d["span_us"].append(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"])
        d["busy_us"].append(sum(k["dur"] for k in ks))
        d["kernels"].append(len(ks))
    waits = [r["dur"] for r in runtime if r["name"] in ("cudaEventSynchronize", "cudaStreamSynchronize")]
    lines = [
        "| stage | host launch us | launch to first kernel us | GPU span us | kernel busy us | kernels |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in per.items():
        med = {k: statistics.median(v) for k, v in d.items()}
        lines.append(
            f"| {name} | {med['launch_us']:.1f} | {med['queue_us']:.1f} | {med['span_us']:.1f} | "
            f"{med['busy_us']:.1f} | {med['kernels']:.0f} |"
        )
    firsts = [st for st in stages if st["name"] == stages[0]["name"]]
    periods = [b["ts"] - a["ts"] for a, b in zip(firsts, firsts[1:])]
    if periods and waits:
        lines.append(
            f"\nround period (first stage to first stage, median) {statistics.median(periods):.1f} us; "
            f"host waits for the device: median {statistics.median(waits):.1f} us over {len(waits)}"
        )
    return "\n".join(lines)


def table(rows, limit: int) -> str:
    lines = ["| kernel | launches | us |", "|---|---|---|"]
    for name, n, us in rows[:limit]:
        lines.append(f"| `{name[:90]}` | {n:.1f} | {us:.1f} |")
    lines.append(f"| all | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows):.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", choices=("nano", "small"), default="nano")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    device = torch.device("cuda")
    model, drafter, prompts = load_pair(a.target, device, a.new_tokens)
    out = [f"# profile_round: {a.target}, budget {a.budget}, {torch.cuda.get_device_name(device)}"]
    for batch in a.batch:
        group = (prompts * batch)[:batch]
        config = GenerationConfig(method="ddtree", budget=a.budget, max_new_tokens=a.new_tokens)
        generate(model, drafter, group, config)  # compiles
        res = generate(model, drafter, group, config)
        st = res.stats
        rounds = st.rounds
        stages = {k: 1e3 * v / rounds for k, v in st.stage_times.items() if v}
        untimed = generate(model, drafter, group, config, stage_timing=False).stats
        with labelled_stages(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(model, drafter, group, config, stage_timing=False)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            trace = json.loads(Path(f"{tmp}/trace.json").read_text())
        out.append(
            f"\n## batch {batch}: {rounds} rounds, tau {sum(st.accept_lengths) / len(st.accept_lengths):.2f}"
        )
        out.append("stage ms per round (timer on): " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
        out.append(
            f"ms per decoding round, timer off: {1e3 * untimed.round_time:.3f} ({untimed.rounds} rounds)\n"
        )
        out.append(timeline(trace))
        out.append("\nkernels of the whole generate() call, per round:\n")
        cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out.append(table(kernel_rows(cuda, untimed.rounds), a.rows))
        capture = tuple(drafter.target_layer_ids)
        forward = forward_call(model, batch, a.budget + 1, 200, impl=None, capture=capture)
        forward()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
        us = time_graph(forward).median_us
        out.append(
            f"\nisolated verify forward of {a.budget + 1} nodes (graph replay {us:.0f} us), eager kernels:\n"
        )
        cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out.append(table(kernel_rows(cuda, 1), a.rows))
        print("\n".join(out[-6:]), flush=True)
    text = "\n".join(out) + "\n"
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"profile_round_{a.target}.md").write_text(text)


if __name__ == "__main__":
    main()
