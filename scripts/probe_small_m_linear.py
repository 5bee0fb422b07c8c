"""The small-M launch of our GEMM (kernels/linear.py, `invariant=False`) against cuBLAS at the
projection shapes of a decode step and a tree verify (issue 27): the scaled-down Kimi target's (the
2.5B shape of `bench e2e`: q_a + kv_a, q_b, o_proj, the dense MLP, lm_head, and the per-head W_UK / W_UV
products that torch runs as bmm) and one GPU's share of Kimi-K2 (tp 8). For each shape and M, cuBLAS
(F.linear, or torch.bmm for the per-head products), the invariant launch, the small-M launch's default
and each candidate launch (BLOCK_N, BLOCK_K, warps, stages; BLOCK_M is M's tile), all on the same inputs.

Timing: bench/timing.time_graph (CUDA-graph replays, the L2 flushed before each, medians), each call on
its own copy of the weight (as the layers of a forward: the weights are read from memory, not from the
L2), the time per call. Every result is checked against cuBLAS's (largest difference relative to the
output's largest magnitude). Prints a markdown table and writes it to $OUT/probe_small_m_linear.md.

    python scripts/probe_small_m_linear.py [--rows 1 33] [--candidates 16,128,4,4 32,256,4,3] [--shapes small]
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.kernels import linear as kernels

# name: (heads or 0 for a plain projection, N, K)
SHAPES = {
    "small q_a + kv_a": (0, 768 + 576, 2048),
    "small q_b": (0, 16 * 192, 768),
    "small o_proj": (0, 2048, 16 * 128),
    "small dense gate": (0, 6144, 2048),
    "small dense down": (0, 2048, 6144),
    "small W_UK (per head)": (16, 512, 128),
    "small W_UV (per head)": (16, 128, 512),
    "small lm_head": (0, 163840, 2048),
    "Kimi q_a + kv_a": (0, 1536 + 576, 7168),
    "Kimi q_b (8 heads)": (0, 8 * 192, 1536),
    "Kimi o_proj (8 heads)": (0, 7168, 8 * 128),
}
DEFAULT_CANDIDATES = ("16,128,4,4", "16,256,4,4", "16,128,4,6", "32,128,4,4", "32,256,4,3", "64,128,4,4",
                      "16,64,4,6", "16,256,2,4", "32,64,4,6")  # fmt: skip
WEIGHT_BYTES = 96 << 20  # each timed graph reads at least this much weight (copies of it)


def parse_candidate(text: str) -> tuple[int, int, int, int]:
    """'block_n,block_k,warps,stages' -> ints (ValueError naming --candidates otherwise)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) <= 0 or any(v & (v - 1) for v in values[:2]):
        raise ValueError(f"--candidates: expected block_n,block_k,warps,stages (powers of two), got {text!r}")
    return values  # type: ignore[return-value]


@contextlib.contextmanager
def forced(candidate: tuple[int, int, int, int] | None):
    """kernels.linear's small-M launches inside use `candidate` (None: the default)."""
    default = kernels.small_m_launch
    if candidate is not None:
        block_n, block_k, warps, stages = candidate

        def launch(m: int, n: int, k: int, itemsize: int) -> kernels.Launch:
            return kernels.Launch(block_n, block_k, warps, stages, block_m=default(m, n, k, itemsize).block_m)

        kernels.small_m_launch = launch
    try:
        yield
    finally:
        kernels.small_m_launch = default


def make_calls(heads: int, n: int, k: int, m: int, copies: int, device) -> dict:
    """Callables per method over `copies` weights: 'cublas', 'invariant', 'small' (the small-M launch)."""
    gen = torch.Generator(device=device).manual_seed(m * 7 + n)
    if heads:  # x [h, M, K]; weight stored [h, K, N] as the model's kv_b views are read: W^T per head
        x = torch.randn(heads, m, k, device=device, generator=gen).bfloat16()
        ws = [
            (torch.randn(heads, k, n, device=device, generator=gen) * k**-0.5).bfloat16()
            for _ in range(copies)
        ]
        outs = [torch.empty(heads, m, n, device=device, dtype=torch.bfloat16) for _ in ws]

        def per_head(invariant):
            return [lambda w=w, o=o: kernels.batched_linear_into(x, w.transpose(1, 2), o, invariant=invariant)
                    for w, o in zip(ws, outs)]  # fmt: skip

        return {"cublas": [lambda w=w, o=o: torch.bmm(x, w, out=o) for w, o in zip(ws, outs)],
                "invariant": per_head(True), "small": per_head(False)}  # fmt: skip
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    ws = [(torch.randn(n, k, device=device, generator=gen) * k**-0.5).bfloat16() for _ in range(copies)]
    return {"cublas": [lambda w=w: F.linear(x, w) for w in ws],
            "invariant": [lambda w=w: kernels.linear(x, w) for w in ws],
            "small": [lambda w=w: kernels.linear(x, w, invariant=False) for w in ws]}  # fmt: skip


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def rows_for(name: str, m: int, candidates: list, timer, device) -> list[list]:
    """One table row per method and candidate at (shape `name`, M = m)."""
    heads, n, k = SHAPES[name]
    copies = max(1, min(16, -(-WEIGHT_BYTES // (max(heads, 1) * n * k * 2))))
    calls = make_calls(heads, n, k, m, copies, device)
    want = calls["cublas"][0]()
    want = want.clone()
    cublas = timer(calls["cublas"])
    out = [[name, m, "cuBLAS", f"{cublas:.1f}", "1.00x", "0"]]
    runs = [("invariant", None, "invariant"), ("small-M default", None, "small")]
    runs += [(",".join(map(str, c)), c, "small") for c in candidates]
    for label, candidate, method in runs:
        with forced(candidate):
            err = rel_err(calls[method][0](), want)
            us = timer(calls[method])
        out.append([name, m, label, f"{us:.1f}", f"{us / cublas:.2f}x", f"{err:.1e}"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 33])
    parser.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES))
    parser.add_argument("--shapes", nargs="+", default=["small", "Kimi"], help="name prefixes of SHAPES")
    parser.add_argument("--rep-ms", type=float, default=20.0)
    args = parser.parse_args()
    try:
        candidates = [parse_candidate(c) for c in args.candidates]
    except ValueError as exc:
        parser.exit(2, f"probe_small_m_linear: {exc}\n")
    if any(not 0 < m <= kernels.SMALL_M for m in args.rows):
        parser.exit(2, f"probe_small_m_linear: --rows must be in 1..{kernels.SMALL_M}\n")
    names = [s for s in SHAPES if any(s.startswith(p) for p in args.shapes)]
    if not names:
        parser.exit(2, f"probe_small_m_linear: --shapes matches none of {list(SHAPES)}\n")
    if not torch.cuda.is_available():
        parser.exit(2, "probe_small_m_linear: needs a CUDA GPU\n")
    from kdtree_engine.bench.timing import time_graph

    def timer(fns):
        return time_graph(fns, rep_ms=args.rep_ms).median_us

    table = []
    for name in names:
        for m in args.rows:
            for row in rows_for(name, m, candidates, timer, torch.device("cuda")):
                table.append(row)
                print(row, flush=True)
    title = (
        f"Small-M GEMM launches against cuBLAS, bf16, {torch.cuda.get_device_name()}, {utc_stamp()} (time "
        "per call, each call on its own weight copy; launch = BLOCK_N,BLOCK_K,warps,stages)"
    )
    heads = ["projection", "M", "launch", "us", "/ cuBLAS", "max rel. diff to cuBLAS"]
    text = f"{title}\n\n" + markdown_table(heads, table) + "\n"
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_small_m_linear.md").write_text(text)


if __name__ == "__main__":
    main()
