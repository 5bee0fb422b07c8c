"""The router's matmul launch tried side by side (issue 27): `kernels.moe_router.router_logits` at the
scaled-down Kimi shape (E = 32 experts, H = 2048; Kimi-K2's E = 384, H = 7168 with --kimi) for N tokens,
its default launch against candidates (experts per program, hidden columns per step, warps), timed by
bench/timing.time_graph (CUDA-graph replays, the L2 flushed, medians). None of these changes a logit's
bits on the GPU (each is a sequential float32 FMA chain over its chunk whatever the blocks), which the
table checks against the default. Why: `scripts/profile_decode.py --graph` found this launch a large share
of the 2.5B decode step (docs/engine.md). Prints a markdown table, writes it under $OUT.

    python scripts/probe_router_launch.py [--tokens 1 33] [--candidates 16,64,4 32,256,4 16,256,2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.kernels import moe_router

DEFAULT_CANDIDATES = ("16,64,4", "32,256,4", "16,256,4", "16,256,2", "32,128,8")


def parse_candidate(text: str) -> tuple[int, int, int]:
    """'block_e,block_k,warps' -> ints (ValueError naming --candidates otherwise)."""
    try:
        block_e, block_k, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--candidates: expected e,k,warps, got {text!r}") from None
    return block_e, block_k, warps


@contextlib.contextmanager
def forced(candidate: tuple[int, int, int] | None):
    """router_logits calls inside use `candidate`'s launch (None: the default)."""
    saved = moe_router.logit_block_e, moe_router.LOGIT_BLOCK_K, moe_router.LOGIT_WARPS
    if candidate is not None:
        block_e, moe_router.LOGIT_BLOCK_K, moe_router.LOGIT_WARPS = candidate
        moe_router.logit_block_e = lambda n_experts: block_e
    try:
        yield
    finally:
        moe_router.logit_block_e, moe_router.LOGIT_BLOCK_K, moe_router.LOGIT_WARPS = saved


def compare(x: torch.Tensor, weight: torch.Tensor, candidates: list, timer) -> list[dict]:
    """Per candidate (None first: the default): time by `timer(call)` and whether the partial logits are
    the default's bits."""
    base = moe_router.router_logits(x, weight)
    rows = []
    for c in [None, *candidates]:
        with forced(c):
            same = bool(torch.equal(moe_router.router_logits(x, weight), base))
            rows.append(
                {"candidate": c, "us": timer(lambda: moe_router.router_logits(x, weight)), "same": same}
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 33, 65])
    parser.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES))
    parser.add_argument("--kimi", action="store_true", help="Kimi-K2's router (E 384, H 7168)")
    parser.add_argument("--rep-ms", type=float, default=30)
    args = parser.parse_args()
    try:
        candidates = [parse_candidate(c) for c in args.candidates]
    except ValueError as exc:
        parser.exit(2, f"probe_router_launch: {exc}\n")
    if not torch.cuda.is_available():
        parser.exit(2, "probe_router_launch: needs a CUDA GPU\n")
    from kdtree_engine.bench.timing import time_graph

    experts, hidden = (384, 7168) if args.kimi else (32, 2048)
    device = torch.device("cuda")
    weight = torch.randn(experts, hidden, device=device) * hidden**-0.5
    table = []
    for n in args.tokens:
        x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
        for r in compare(x, weight, candidates, lambda call: time_graph(call, rep_ms=args.rep_ms).median_us):
            name = "default" if r["candidate"] is None else ",".join(str(v) for v in r["candidate"])
            table.append([n, name, f"{r['us']:.1f}", r["same"]])
            print(table[-1], flush=True)
    gpu = torch.cuda.get_device_name(device)
    title = f"Router matmul launches, {gpu}, {utc_stamp()}, E {experts}, H {hidden}"
    text = f"{title}\n\n" + markdown_table(["N", "BLOCK_E,BLOCK_K,warps", "us", "bits equal default"], table)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_router_launch.md").write_text(text)


if __name__ == "__main__":
    main()
