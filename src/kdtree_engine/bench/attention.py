"""`kdtree-engine bench attention`: tree-verify MLA attention against naive torch and the roofline.

Kimi-K2 shapes per layer (d_c = 512, d_r = 64, bf16): h heads, t tree nodes per request, s cached
tokens (prefix + tree) per request, b requests. Work per request: 2*t*h*(576+512)*s FLOPs and 576*2*s
bytes of cache. Times are GPU times per call (bench/timing.time_graph: the median of CUDA-graph replays
timed by triton.testing.do_bench, the L2 flushed before each replay) of several calls on distinct
inputs, so that the calls after the first do not find their cache in the L2 either; host launch overhead
is excluded. Each problem's attention plan is built once, outside the
timing, as a model builds it once per forward for all its layers: the time is one layer's. "us" runs the
plan built with validation (the lengths known on the host); "device-planned us" runs the plan a
captured forward builds (no host read: the schedule from the device, the merge always launched). The
roofline is measured in the same run: a device-to-device
copy (bytes read + written) and a large bf16 matmul; roof% = max(FLOPs / matmul rate, bytes / copy
rate) / our time.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from kdtree_engine.bench import flashmla
from kdtree_engine.bench.plot import markdown_table, utc_stamp

D_C, D_R = 512, 64
D = D_C + D_R
NAIVE_MAX_BYTES = 40 << 30  # skip naive torch where its fp32 score matrix would not fit comfortably
ROTATE_BYTES = 256 << 20  # cache bytes touched per timed graph, several times the 50 MB L2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 17, 33, 65], help="tree sizes t")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 32768], help="cache lengths s")
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--page-size", type=int, default=0, help="0: contiguous cache; else paged")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive torch baseline")
    flashmla_help = "skip FlashMLA (timed by default where the flash_mla package imports)"
    parser.add_argument("--no-flashmla", action="store_true", help=flashmla_help)
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per point, ms")
    invariant_help = "also time the Triton kernel's row-invariant mode (issue 32) on the same inputs"
    parser.add_argument("--invariant", action="store_true", help=invariant_help)
    parser.add_argument("--out", type=Path, default=Path("out/attention"), help="output directory")


def _tree_visibility(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Random trees [b, t, t] bool (node i's parent is uniform over 0..i-1)."""
    vis = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
    for i in range(1, t):
        parent = torch.randint(0, i, (b,), generator=gen)
        vis[:, i] |= vis[torch.arange(b), parent]
    return vis


def make_problem(b: int, t: int, h: int, s: int, page: int, device: torch.device, seed: int = 0) -> dict:
    """Random bf16 problem with every request at length s (prefix s - t plus the tree)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, D, device=device, dtype=torch.bfloat16)
    kv = torch.randn(b, s, D, device=device, dtype=torch.bfloat16)
    problem = {"q": q, "kv": kv, "lengths": torch.full((b,), s, device=device, dtype=torch.int32)}
    problem["vis"] = _tree_visibility(b, t, gen).to(device)
    problem["block_table"] = None
    if page:
        pages = -(-s // page)
        order = torch.randperm(b * pages, generator=gen).to(device)
        paged = torch.empty(b * pages, page, D, device=device, dtype=torch.bfloat16)
        padded = torch.nn.functional.pad(kv, (0, 0, 0, pages * page - s)).view(b * pages, page, D)
        paged[order] = padded
        problem["kv"], problem["block_table"] = paged, order.view(b, pages).int()
    return problem


def naive_attention(q, kv, vis, scale: float) -> torch.Tensor:
    """Absorbed attention the plain way: bf16 matmul, fp32 masked softmax, bf16 matmul. Uniform lengths."""
    b, t, h, d = q.shape
    scores = torch.bmm(q.view(b, t * h, d), kv.transpose(1, 2)).float() * scale  # [b, t*h, s]
    tree_mask = vis.repeat_interleave(h, dim=1)  # [b, t*h, t]
    scores[..., -t:].masked_fill_(~tree_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, kv[..., :D_C]).view(b, t, h, D_C)


def measure_roofline(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written per second) and dense bf16 matmul rate, measured now with
    the harness of every benchmark (bench/timing.py)."""
    from kdtree_engine.bench.timing import device_copy_bandwidth, time_graph

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_us = time_graph(lambda: a @ w, rep_ms=200).median_us
    return {"copy_GBps": device_copy_bandwidth(device) / 1e9, "matmul_TFLOPs": 2 * 8192**3 / mm_us / 1e6}


def work(b: int, t: int, h: int, s: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one layer's attention for the batch."""
    return 2.0 * t * h * (D + D_C) * s * b, float(D * 2 * s * b)


def graph_us(calls: list, rep: int) -> float:
    """GPU time of one call (bench/timing.time_graph): the calls, each on its own inputs so that together
    they overflow the L2, captured in one CUDA graph whose replays are timed."""
    from kdtree_engine.bench.timing import time_graph

    return time_graph(calls, rep_ms=rep, warmup=1).median_us


def time_point(b, t, h, s, args, roof, device) -> dict:
    from kdtree_engine.attention import plan_attention

    kv_bytes = b * s * D * 2
    copies = max(1, min(32, -(-ROTATE_BYTES // kv_bytes)))
    problems = [make_problem(b, t, h, s, args.page_size, device, seed=i) for i in range(copies)]
    scale = 192**-0.5

    def ours(p, impl=None, validate=True, invariant=False):
        plan = plan_attention(p["q"], p["kv"], p["lengths"], softmax_scale=scale, d_v=D_C,
                              visibility=p["vis"], block_table=p["block_table"], impl=impl,
                              validate=validate, invariant=invariant)  # fmt: skip
        return plan, lambda: plan.run(p["q"], p["kv"])

    flops, nbytes = work(b, t, h, s)
    row = {"h": h, "t": t, "s": s, "b": b, "copies": copies}
    plans = [ours(p) for p in problems]
    row["kernel"] = plans[0][0].kernel
    row["us"] = graph_us([call for _, call in plans], args.rep)
    row.update(tflops=flops / row["us"] / 1e6, gbps=nbytes / row["us"] / 1e3)
    row["device_planned_us"] = graph_us([ours(p, validate=False)[1] for p in problems], args.rep)
    out, _ = plans[0][1]()
    if row["kernel"] == "hopper":  # the Triton kernel, same run: what the Hopper kernel adds
        row["triton_us"] = graph_us([ours(p, impl="triton")[1] for p in problems], args.rep)
        tri, _ = ours(problems[0], impl="triton")[1]()
        row["max_err_vs_triton"] = _max_diff(out, tri)
    if getattr(args, "invariant", False):  # the row-invariant mode: its cost against the fastest kernel
        row["invariant_us"] = graph_us([ours(p, invariant=True)[1] for p in problems], args.rep)
        row["max_err_invariant"] = _max_diff(out, ours(problems[0], invariant=True)[1]()[0])
    floor_us = max(flops / roof["matmul_TFLOPs"] / 1e6, nbytes / roof["copy_GBps"] / 1e3)
    row["roof_pct"] = 100 * floor_us / row["us"]
    dense = args.page_size == 0
    if not args.no_naive and dense and copies * b * t * h * s * 12 < NAIVE_MAX_BYTES:
        p = problems[0]
        want = naive_attention(p["q"], p["kv"], p["vis"], scale)
        row["max_err_vs_naive"] = _max_diff(out, want)
        naive = [lambda p=p: naive_attention(p["q"], p["kv"], p["vis"], scale) for p in problems]
        naive_us = graph_us(naive, args.rep)
        row.update(naive_us=naive_us, naive_tflops=flops / naive_us / 1e6, naive_gbps=nbytes / naive_us / 1e3)
        row["speedup"] = naive_us / row["us"]
    if getattr(args, "flashmla", None) is not None:
        row.update(flashmla_row(args.flashmla, problems, out, scale, args))
    plans.clear()
    problems.clear()
    torch.cuda.empty_cache()
    return row


def flashmla_row(module, problems: list[dict], ours_out: torch.Tensor, scale: float, args) -> dict:
    """FlashMLA causal and the cascade (bench/flashmla.py) on the same problems: their times, ours over
    theirs, and their largest difference from our kernel (causal: against ours with a causal mask);
    empty where FlashMLA cannot read the cache (pages other than 64 rows)."""
    from kdtree_engine.attention import tree_mla_attention

    if args.page_size not in (0, flashmla.PAGE) or problems[0]["kv"].shape[1] % flashmla.PAGE:
        return {}
    p = problems[0]

    def causal(p):
        return flashmla.causal_call(module, p["q"], p["kv"], p["lengths"], p["block_table"], scale, D_C)

    def cascade(p):
        return flashmla.cascade_call(module, p["q"], p["kv"], p["lengths"], p["block_table"], p["vis"],
                                     scale, D_C)  # fmt: skip

    ours_causal, _ = tree_mla_attention(p["q"], p["kv"], p["lengths"], softmax_scale=scale, d_v=D_C,
                                        block_table=p["block_table"])  # fmt: skip
    causals, cascades = [causal(q) for q in problems], [cascade(q) for q in problems]
    row = {"flashmla_us": graph_us(causals, args.rep), "cascade_us": graph_us(cascades, args.rep)}
    row["max_err_flashmla_vs_ours_causal"] = _max_diff(causals[0]()[0], ours_causal)
    row["max_err_cascade_vs_ours"] = _max_diff(cascades[0]()[0], ours_out)
    return row


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def markdown(rows: list[dict], roof: dict, header: str) -> str:
    headers = ["h", "t", "s", "b", "kernel", "us", "TFLOP/s", "GB/s", "roof %", "device-planned us",
               "Triton-only us", "naive us", "naive TFLOP/s", "speedup"]  # fmt: skip
    invariant = any("invariant_us" in r for r in rows)
    if invariant:
        headers += ["row-invariant us", "row-invariant / ours", "max diff"]
    peers = any("flashmla_us" in r for r in rows)
    if peers:
        headers += ["FlashMLA causal us", "ours / FlashMLA", "cascade us", "ours / cascade", "max diff"]
    table = []
    for r in rows:
        tri = f"{r['triton_us']:.1f}" if "triton_us" in r else None
        naive = (
            [f"{r['naive_us']:.1f}", f"{r['naive_tflops']:.0f}", f"{r['speedup']:.2f}x"]
            if "naive_us" in r
            else [None] * 3
        )
        ours = [f"{r['us']:.1f}", f"{r['tflops']:.0f}", f"{r['gbps']:.0f}", f"{r['roof_pct']:.0f}",
                f"{r['device_planned_us']:.1f}"]  # fmt: skip
        table.append([r["h"], r["t"], r["s"], r["b"], r["kernel"], *ours, tri, *naive])
        if invariant:
            table[-1] += [f"{r['invariant_us']:.1f}", f"{r['invariant_us'] / r['us']:.2f}",
                          f"{r['max_err_invariant']:.2g}"]  # fmt: skip
        if peers:
            table[-1] += _flashmla_cells(r)
    return (
        f"{header}\n\n{markdown_table(headers, table)}\n\n"
        f"Roofline measured in this run: copy {roof['copy_GBps']:.0f} GB/s, "
        f"bf16 matmul {roof['matmul_TFLOPs']:.0f} TFLOP/s.\n"
    )


def _flashmla_cells(r: dict) -> list:
    """FlashMLA causal and cascade us, ours over each, and the larger of their differences from ours."""
    if "flashmla_us" not in r:
        return [None] * 5
    diff = max(r["max_err_flashmla_vs_ours_causal"], r["max_err_cascade_vs_ours"])
    return [f"{r['flashmla_us']:.1f}", f"{r['us'] / r['flashmla_us']:.2f}", f"{r['cascade_us']:.1f}",
            f"{r['us'] / r['cascade_us']:.2f}", f"{diff:.2g}"]  # fmt: skip


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["h"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False)
    for ax, h in zip(axes[0], heads):
        metric, unit = ("tflops", "TFLOP/s") if h >= 32 else ("gbps", "GB/s")
        for (s, b), color in zip(
            sorted({(r["s"], r["b"]) for r in rows if r["h"] == h}), itertools.cycle("bgrcmyk")
        ):
            pts = sorted((r for r in rows if (r["h"], r["s"], r["b"]) == (h, s, b)), key=lambda r: r["t"])
            ax.plot(
                [r["t"] for r in pts], [r[metric] for r in pts], "-o", color=color, label=f"ours s={s} b={b}"
            )
            naive = [r for r in pts if "naive_us" in r]
            ax.plot([r["t"] for r in naive], [r["naive_" + metric] for r in naive], "--x", color=color,
                    alpha=0.6, label=f"naive s={s} b={b}")  # fmt: skip
        ax.set(xlabel="tree size t", ylabel=unit, title=f"h={h}")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench attention: needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    stamp = utc_stamp()
    roof = measure_roofline(device)
    args.flashmla = None if args.no_flashmla else flashmla.load()
    header = (
        f"Tree-verify MLA attention, {name}, {stamp}, torch {torch.__version__}, bf16, d=512+64, "
        f"{'paged ' + str(args.page_size) if args.page_size else 'contiguous'} cache"
        + (
            "; FlashMLA " + getattr(args.flashmla, "__version__", "?")
            if args.flashmla
            else "; FlashMLA not timed"
        )
    )
    print(header, json.dumps(roof), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for h, t, s, b in itertools.product(args.heads, args.tokens, args.seqlens, args.batch):
        if s < t:
            continue
        rows.append(time_point(b, t, h, s, args, roof, device))
        r = rows[-1]
        print(
            f"h={h} t={t} s={s} b={b}: {r['us']:.1f} us {r['tflops']:.0f} TFLOP/s {r['gbps']:.0f} GB/s "
            f"roof {r['roof_pct']:.0f}% naive {r.get('naive_us', float('nan')):.1f} us "
            f"speedup {r.get('speedup', float('nan')):.2f}x [{r['kernel']}; device-planned "
            f"{r['device_planned_us']:.1f} us; Triton-only "
            f"{r.get('triton_us', float('nan')):.1f} us, max diff {r.get('max_err_vs_triton', 0):.3g}]",
            flush=True,
        )
        summary = {"header": header, "roof": roof, "rows": rows}  # rewritten per point: a cut run keeps them
        (args.out / "attention.json").write_text(json.dumps(summary, indent=1))
        table = markdown(rows, roof, header)
        (args.out / "attention.md").write_text(table)
    plot(rows, args.out / "attention.png", header)
    print(markdown(rows, roof, header))
    return 0
