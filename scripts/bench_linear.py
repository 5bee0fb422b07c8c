"""What row invariance costs in the projections (issue 32): the row-invariant GEMM (kernels/linear.py)
against cuBLAS (torch.nn.functional.linear) on the same bf16 inputs, at the projection shapes of one
GPU's share of Kimi-K2 (bench/kimi_layer.py: tp 8) and of the scaled-down Kimi target, for M rows from
a decode step to a batched verify and a prefill. GPU times of CUDA-graph replays (bench/timing.time_graph,
the L2 flushed before each), medians; the roofline is the weight, input and output bytes over the copy
bandwidth measured in the same run. "rows equal" checks, at each M, that the invariant kernel gave the
first row the bits it has at M = 1 (cuBLAS's column says the same of cuBLAS). Prints a markdown table and
writes it to $OUT/bench_linear.md when OUT is set.

    python scripts/bench_linear.py [--rows 1 2 9 33 65 528 2112 4096] [--rep-ms 50]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.bench.timing import device_copy_bandwidth, time_graph
from kdtree_engine.kernels.linear import linear

SHAPES = {  # name: (N, K)
    "Kimi q_a + kv_a (fused)": (1536 + 576, 7168),
    "Kimi q_b (8 heads)": (8 * 192, 1536),
    "Kimi o_proj (8 heads)": (7168, 8 * 128),
    "Kimi lm_head rows (1/8)": (20480, 7168),
    "small q_a + kv_a (fused)": (768 + 576, 2048),
    "small o_proj": (2048, 16 * 128),
    "small dense MLP gate": (6144, 2048),
}


def row(name: str, n: int, k: int, m: int, rep_ms: float, copy_bw: float) -> list:
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    cublas = time_graph(lambda: F.linear(x, w), rep_ms=rep_ms).median_us
    ours = time_graph(lambda: linear(x, w), rep_ms=rep_ms).median_us
    roof = (n * k + m * (k + n)) * 2 / copy_bw * 1e6
    same_ours = torch.equal(linear(x, w)[:1], linear(x[:1], w))
    same_cublas = torch.equal(F.linear(x, w)[:1], F.linear(x[:1], w))
    return [name, m, n, k, f"{cublas:.1f}", f"{ours:.1f}", f"{ours / cublas:.2f}x", f"{roof:.1f}",
            "yes" if same_ours else "NO", "yes" if same_cublas else "no"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 9, 33, 65, 528, 2112, 4096])
    parser.add_argument("--rep-ms", type=float, default=50.0)
    args = parser.parse_args()
    copy_bw = device_copy_bandwidth()
    body = [row(name, n, k, m, args.rep_ms, copy_bw) for name, (n, k) in SHAPES.items() for m in args.rows]
    heads = ["projection", "M", "N", "K", "cuBLAS us", "invariant us", "invariant / cuBLAS", "roofline us",
             "rows equal (invariant)", "rows equal (cuBLAS)"]  # fmt: skip
    text = (f"Row-invariant GEMM against cuBLAS, bf16: {torch.cuda.get_device_name()}, {utc_stamp()}; copy "
            f"bandwidth {copy_bw / 1e9:.0f} GB/s\n\n" + markdown_table(heads, body) + "\n")  # fmt: skip
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_linear.md").write_text(text)


if __name__ == "__main__":
    main()
