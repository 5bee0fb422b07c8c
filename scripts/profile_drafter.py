"""What one draft stage costs: the shipped kimi-nano target and its DFlash drafter (bf16, CUDA), one
`draft()` per batch size on a context of `--context` cached rows plus a round of block_size new rows
(bench/forward_cost.draft_call), timed as a CUDA graph replay (bench/timing.time_graph: the method of
every benchmark, docs/results.md) for impl="ref" (the torch path: cache concatenated with the block,
heads expanded, masked SDPA) and impl="triton" (the kernels, drafter/fused.py), with the kernels of one
eager draft counted by torch.profiler (bench/timing.count_kernels) and a decode step of the target (a
captured forward of one token per request) for scale. Prints a markdown table and writes it to
$OUT/profile_drafter.md when OUT is set.

    python scripts/profile_drafter.py [--batch 1 4 16 64] [--context 200]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.bench.forward_cost import draft_call, forward_call
from kdtree_engine.bench.timing import count_kernels, time_graph
from kdtree_engine.drafter import load_drafter
from kdtree_engine.model import load_model

IMPLS = ("ref", "triton")


def time_draft(drafter, target, batch: int, context: int, impl: str) -> dict:
    """One round's draft: GPU time of its replay (the reset of the cache length included, one copy
    kernel), kernels of one eager draft (the reset left out), and its logits."""
    reset, draft = draft_call(drafter, target, batch, context, impl)

    def round_():
        reset()
        return draft()

    logits = round_().clone()
    reset()
    kernels = count_kernels(draft)
    return {"ms": time_graph(round_).median_us * 1e-3, "kernels": kernels, "logits": logits}


def decode_ms(target, batch: int, context: int) -> float:
    """A captured target forward of one token per request on `context` cached rows (the kernels)."""
    return time_graph(forward_call(target, batch, 1, context, impl=None)).median_us * 1e-3


def table(rows: list[dict], context: int, layers: int) -> str:
    head = (
        f"kimi-nano drafter ({layers} layers), bf16, {torch.cuda.get_device_name()}, context {context} rows "
        f"+ a round of 16 (5 real), torch {torch.__version__}; CUDA graph replays, bench/timing.time_graph "
        "median\n\n"
        "| batch | impl | draft us | kernels per draft | draft / decode step | max abs logit diff | "
        "argmax equal |\n|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['batch']} | {r['impl']} | {r['ms'] * 1e3:.0f} | {r['kernels']} | {r['ratio']:.2f}x | "
        f"{r['diff']:.3g} | {r['argmax']:.1%} |\n"
        for r in rows
    )
    return head + body


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--context", type=int, default=200)
    a = p.parse_args()
    began = time.perf_counter()
    dev = torch.device("cuda")
    target = load_model(KIMI_NANO, dtype=torch.bfloat16, device=dev)
    drafter = load_drafter(KIMI_NANO_DFLASH, dtype=torch.bfloat16, device=dev)
    rows = []
    for batch in a.batch:
        step = decode_ms(target, batch, a.context)
        runs = {impl: time_draft(drafter, target, batch, a.context, impl) for impl in IMPLS}
        ref = runs["ref"]["logits"]
        for impl, r in runs.items():
            diff = (r["logits"] - ref).abs().max().item()
            argmax = (r["logits"].argmax(-1) == ref.argmax(-1)).float().mean().item()
            rows.append(dict(batch=batch, impl=impl, ms=r["ms"], kernels=r["kernels"], ratio=r["ms"] / step,
                             diff=diff, argmax=argmax))  # fmt: skip
        print(f"batch {batch}: decode step {step * 1e3:.0f} us", flush=True)
    text = table(rows, a.context, drafter.config.num_hidden_layers)
    print(text)
    print(f"({time.perf_counter() - began:.0f} s)")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_drafter.md").write_text(text)


if __name__ == "__main__":
    main()
