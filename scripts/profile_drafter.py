"""What one draft stage costs: the shipped kimi-nano target and its DFlash drafter (bf16, CUDA), one
`draft()` per batch size on a context of `--context` cached rows plus a round of block_size new rows,
timed as a CUDA graph replay (triton.testing.do_bench on graph.replay, median) for impl="ref" (the
torch path: cache concatenated with the block, heads expanded, masked SDPA) and impl="triton" (the
kernels, drafter/fused.py), with the kernels of one eager draft counted by torch.profiler and a decode
step of the target (a captured forward of one token per request) for scale. Prints a markdown table
and writes it to $OUT/profile_drafter.md when OUT is set.

    python scripts/profile_drafter.py [--batch 1 4 16 64] [--context 200]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.drafter import load_drafter
from kdtree_engine.model import load_model

IMPLS = ("ref", "triton")


def draft_inputs(drafter, target, batch: int, context: int):
    """A cache holding `context` rows per request, and one round's inputs: block_size new context rows
    of which 5 are real (accepted nodes + bonus), the bonus token at position context + 5."""
    dev, f = target.device, len(drafter.target_layer_ids) * target.config.hidden_size
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = drafter.new_cache(batch, context + 2 * drafter.block_size)
    prefix = torch.randn(batch, context, f, device=dev, dtype=target.dtype, generator=gen)
    lens = torch.full((batch,), context, device=dev)
    bonus = torch.randint(0, target.config.vocab_size, (batch,), device=dev, generator=gen)
    with torch.no_grad():
        drafter.draft(target, prefix, lens, bonus, lens, cache, impl="ref")  # fills the cache
    ctx = torch.randn(batch, drafter.block_size, f, device=dev, dtype=target.dtype, generator=gen)
    ctx_lens = torch.full((batch,), 5, device=dev)
    return cache, (ctx, ctx_lens, bonus, lens + ctx_lens)


def count_kernels(fn) -> int:
    """CUDA kernels (and memcpy / memset) of one eager call."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def graph_ms(fn) -> float:
    """Median ms of a CUDA graph replay of fn (captured after three eager calls: compilation)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def time_draft(drafter, target, batch: int, context: int, impl: str) -> dict:
    cache, (ctx, ctx_lens, bonus, start) = draft_inputs(drafter, target, batch, context)
    seqlens = cache.seqlens.clone()

    @torch.no_grad()
    def draft():
        cache.seqlens.copy_(seqlens)  # every call drafts the same round (one copy kernel, not counted)
        return drafter.draft(target, ctx, ctx_lens, bonus, start, cache, impl=impl)

    logits = draft()
    kernels = count_kernels(draft) - 1
    return {"ms": graph_ms(draft), "kernels": kernels, "logits": logits.clone()}


def decode_ms(target, batch: int, context: int) -> float:
    """A captured target forward of one token per request on `context` cached rows (the kernels)."""
    cache = target.new_cache(batch, context + 1)
    cache.kv.normal_()
    ids = torch.randint(0, target.config.vocab_size, (batch, 1), device=target.device)

    @torch.no_grad()
    def forward():
        cache.seqlens.fill_(context)
        return target(ids, cache, validate=False)

    return graph_ms(forward)


def table(rows: list[dict], context: int, layers: int) -> str:
    head = (
        f"kimi-nano drafter ({layers} layers), bf16, {torch.cuda.get_device_name()}, context {context} rows "
        f"+ a round of 16 (5 real), torch {torch.__version__}; CUDA graph replay, do_bench median\n\n"
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
