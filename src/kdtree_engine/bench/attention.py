"""`kdtree-engine bench attention`: the Triton tree-verify MLA kernel against naive torch and the roofline.

Kimi-K2 shapes per layer (d_c = 512, d_r = 64, bf16): h heads, t tree nodes per request, s cached
tokens (prefix + tree) per request, b requests. Work per request: 2*t*h*(576+512)*s FLOPs and 576*2*s
bytes of cache. Times are GPU times per call: medians of CUDA-event timings of CUDA-graph replays
(triton.testing.do_bench, L2 flushed before each replay) of several calls on distinct inputs; host
launch overhead is excluded (see graph_us). The roofline is measured in the same run: a device-to-device
copy (bytes read + written) and a large bf16 matmul; roof% = max(FLOPs / matmul rate, bytes / copy
rate) / our time.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table

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
    parser.add_argument("--sweep", action="store_true", help="also time launch-config / split variants")
    parser.add_argument("--sm90-variants", action="store_true",
                        help="also time each sm_90 variant at its default schedule")  # fmt: skip
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per point, ms")
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
    """Copy bandwidth (bytes read + written per second) and dense bf16 matmul rate, measured now."""
    from triton.testing import do_bench

    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ w, rep=200, return_mode="median")
    return {"copy_GBps": 2 * src.numel() * 2 / copy_ms / 1e6, "matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def work(b: int, t: int, h: int, s: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one layer's attention for the batch."""
    return 2.0 * t * h * (D + D_C) * s * b, float(D * 2 * s * b)


def graph_us(calls: list, rep: int) -> float:
    """GPU time of one call: the calls (each on its own inputs, so that together they overflow the L2)
    are captured in one CUDA graph, whose replays are timed (median, L2 flushed before each replay).
    Host launch overhead is left out; it is the same for every call of a captured model step."""
    from triton.testing import do_bench

    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return 1e3 * do_bench(graph.replay, rep=rep, return_mode="median") / len(calls)


def time_point(b, t, h, s, args, roof, device) -> dict:
    from kdtree_engine.kernels import mla_attention as kernels

    kv_bytes = b * s * D * 2
    copies = max(1, min(32, -(-ROTATE_BYTES // kv_bytes)))
    problems = [make_problem(b, t, h, s, args.page_size, device, seed=i) for i in range(copies)]
    scale = 192**-0.5

    def ours(p, config=None, num_splits=None, backend="auto"):
        return lambda: kernels.tree_mla_attention(p["q"], p["kv"], p["lengths"], p["vis"], scale, D_C,
                                                  p["block_table"], max_seqlen=s, config=config,
                                                  num_splits=num_splits, backend=backend)  # fmt: skip

    flops, nbytes = work(b, t, h, s)
    row = {"h": h, "t": t, "s": s, "b": b, "copies": copies}
    row["us"] = graph_us([ours(p) for p in problems], args.rep)
    row.update(tflops=flops / row["us"] / 1e6, gbps=nbytes / row["us"] / 1e3)
    p = problems[0]
    row["backend"] = "sm90" if kernels._sm90_ok(p["q"], p["kv"], D_C, t * h) else "triton"
    if row["backend"] == "sm90":  # the Triton-only kernel, same run: what the sm_90 path adds
        row["triton_us"] = graph_us([ours(p, backend="triton") for p in problems], args.rep)
        out, _ = ours(p)()
        tri, _ = ours(p, backend="triton")()
        row["max_err_vs_triton"] = float((out.float() - tri.float()).abs().max())
    floor_us = max(flops / roof["matmul_TFLOPs"] / 1e6, nbytes / roof["copy_GBps"] / 1e3)
    row["roof_pct"] = 100 * floor_us / row["us"]
    dense = args.page_size == 0
    if not args.no_naive and dense and copies * b * t * h * s * 12 < NAIVE_MAX_BYTES:
        p = problems[0]
        out, _ = ours(p)()
        want = naive_attention(p["q"], p["kv"], p["vis"], scale)
        row["max_err_vs_naive"] = float((out.float() - want.float()).abs().max())
        naive = [lambda p=p: naive_attention(p["q"], p["kv"], p["vis"], scale) for p in problems]
        naive_us = graph_us(naive, args.rep)
        row.update(naive_us=naive_us, naive_tflops=flops / naive_us / 1e6, naive_gbps=nbytes / naive_us / 1e3)
        row["speedup"] = naive_us / row["us"]
    if args.sweep:
        row["variants"] = sweep_variants(problems, ours, row["us"], args.rep)
    elif args.sm90_variants and kernels._sm90_ok(p["q"], p["kv"], D_C, t * h, "sched"):
        names = ("sm90-roles", "sm90-pipe", "sm90-sched", "sm90-wide", "sm90-double", "triton")
        row["variants"] = [
            {"config": v, "us": round(graph_us([ours(p, backend=v) for p in problems], args.rep), 2)}
            for v in names
        ]
        print(f"    sm90 variants: {row['variants']}", flush=True)
    problems.clear()
    torch.cuda.empty_cache()
    return row


CANDIDATES = [(64, 64, 8, 2), (16, 32, 4, 3), (16, 64, 4, 3), (32, 32, 4, 3)]  # (BM, BN, warps, stages)


def sweep_variants(problems, ours, default_us: float, rep: int) -> list[dict]:
    """Time each candidate config at its heuristic split count and at a few fixed split counts."""
    from kdtree_engine.kernels import mla_attention as kernels

    found = []
    for cand, splits in itertools.product(CANDIDATES, [None, 4]):
        cfg = kernels.Config(*cand)
        try:
            us = graph_us([ours(p, cfg, splits) for p in problems], max(20, rep // 4))
        except Exception as exc:  # e.g. out of shared memory for this shape: record and move on
            found.append({"config": list(cand), "splits": splits, "error": str(exc)[:120]})
            continue
        found.append({"config": list(cand), "splits": splits, "us": round(us, 2)})
    p = problems[0]
    if kernels._sm90_ok(p["q"], p["kv"], D_C, p["q"].shape[1] * p["q"].shape[2]):
        variants = ("sm90-roles", "sm90-pipe", "sm90-sched", "sm90-double", "sm90-wide")
        for variant, splits in itertools.product(variants, (None, 1, 2, 4, 8, 16)):
            us = graph_us([ours(p, None, splits, variant) for p in problems], max(20, rep // 4))
            found.append({"config": variant, "splits": splits, "us": round(us, 2)})
    ranked = sorted((v for v in found if "us" in v), key=lambda v: v["us"])
    print(f"    default {default_us:.1f} us; best: {ranked[:4]}", flush=True)
    return found


def markdown(rows: list[dict], roof: dict, header: str) -> str:
    headers = ["h", "t", "s", "b", "kernel", "us", "TFLOP/s", "GB/s", "roof %", "Triton-only us",
               "naive us", "naive TFLOP/s", "speedup"]  # fmt: skip
    table = []
    for r in rows:
        tri = f"{r['triton_us']:.1f}" if "triton_us" in r else None
        naive = (
            [f"{r['naive_us']:.1f}", f"{r['naive_tflops']:.0f}", f"{r['speedup']:.2f}x"]
            if "naive_us" in r
            else [None] * 3
        )
        ours = [f"{r['us']:.1f}", f"{r['tflops']:.0f}", f"{r['gbps']:.0f}", f"{r['roof_pct']:.0f}"]
        table.append([r["h"], r["t"], r["s"], r["b"], r.get("backend", "triton"), *ours, tri, *naive])
    return (
        f"{header}\n\n{markdown_table(headers, table)}\n\n"
        f"Roofline measured in this run: copy {roof['copy_GBps']:.0f} GB/s, "
        f"bf16 matmul {roof['matmul_TFLOPs']:.0f} TFLOP/s.\n"
    )


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
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    roof = measure_roofline(device)
    header = (
        f"Tree-verify MLA attention, {name}, {stamp}, torch {torch.__version__}, bf16, d=512+64, "
        f"{'paged ' + str(args.page_size) if args.page_size else 'contiguous'} cache"
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
            f"speedup {r.get('speedup', float('nan')):.2f}x [{r['backend']}; Triton-only "
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
