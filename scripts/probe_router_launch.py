"""The router's matmul launch tried side by side (issue 27): `kernels.moe_router` at the scaled-down
Kimi shape (E = 32 experts top-6, H = 2048; Kimi-K2's E = 384 top-8, H = 7168 with --kimi) for N
tokens, its default launch against candidates (experts per program, hidden columns per step, warps and,
optionally, the chunk of H per partial logit), timed by bench/timing.time_graph (CUDA-graph replays,
the L2 flushed, medians): the matmul alone (router_logits) and the router's two launches
(route_hidden). A candidate with the default chunk must give the default's bits (each partial is a
sequential float32 FMA chain over its chunk whatever the blocks), which the table checks; another chunk
gives other bits by design (still the same for a row whatever the launch). Why: `scripts/profile_decode.py
--graph` found the matmul a large share of the 2.5B decode step (docs/engine.md). Prints a markdown
table, writes it under $OUT.

    python scripts/probe_router_launch.py [--tokens 1 33] [--candidates 16,64,4 16,64,1,128]
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.kernels import moe_router

DEFAULT_CANDIDATES = (
    "32,64,1",
    "16,64,2",
    "16,64,4",
    "16,64,1,128",
    "16,128,1,128",
    "16,64,1,256",
    "16,32,1,32",
)


def parse_candidate(text: str) -> tuple[int, ...]:
    """'block_e,block_k,warps[,chunk]' -> ints (ValueError naming --candidates otherwise)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (3, 4) or min(values) <= 0 or (len(values) == 4 and values[3] % values[1]):
        raise ValueError(f"--candidates: expected e,k,warps[,chunk] (chunk a multiple of k), got {text!r}")
    return values


@contextlib.contextmanager
def forced(candidate: tuple[int, ...] | None):
    """moe_router's calls inside use `candidate`'s launch (None: the default)."""
    default = moe_router.logit_launch
    if candidate is not None:
        block_e, block_k, warps = candidate[:3]

        def launch(hidden: int, n_experts: int) -> moe_router.LogitLaunch:
            chunk = candidate[3] if len(candidate) == 4 else default(hidden, n_experts).chunk
            if chunk % block_k:
                raise ValueError(f"--candidates: BLOCK_K {block_k} does not divide the chunk {chunk}")
            return moe_router.LogitLaunch(chunk, block_e, block_k, warps)

        moe_router.logit_launch = launch
    try:
        yield
    finally:
        moe_router.logit_launch = default


def compare(x: torch.Tensor, weight: torch.Tensor, route_args: dict, candidates: list, timer) -> list[dict]:
    """Per candidate (None first: the default): the matmul's and route_hidden's times by `timer(call)`,
    and whether the partial logits are the default's bits."""
    base = moe_router.router_logits(x, weight)
    rows = []
    for c in [None, *candidates]:
        with forced(c):
            parts = moe_router.router_logits(x, weight)
            rows.append({
                "candidate": c,
                "us": timer(lambda: moe_router.router_logits(x, weight)),
                "route_us": timer(lambda: moe_router.route_hidden(x, weight, **route_args)),
                "same": parts.shape == base.shape and bool(torch.equal(parts, base)),
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 33, 65])
    parser.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES))
    parser.add_argument("--kimi", action="store_true", help="Kimi-K2's router (E 384 top-8, H 7168)")
    parser.add_argument("--rep-ms", type=float, default=30)
    args = parser.parse_args()
    try:
        candidates = [parse_candidate(c) for c in args.candidates]
    except ValueError as exc:
        parser.exit(2, f"probe_router_launch: {exc}\n")
    if not torch.cuda.is_available():
        parser.exit(2, "probe_router_launch: needs a CUDA GPU\n")
    from kdtree_engine.bench.timing import time_graph

    experts, hidden, top_k = (384, 7168, 8) if args.kimi else (32, 2048, 6)
    chunk = moe_router.logit_launch(hidden, experts).chunk
    if any(len(c) == 3 and chunk % c[1] for c in candidates):
        parser.exit(
            2, f"probe_router_launch: --candidates: a BLOCK_K does not divide the default chunk {chunk}\n"
        )
    device = torch.device("cuda")
    weight = torch.randn(experts, hidden, device=device) * hidden**-0.5
    route_args = dict(bias=torch.randn(experts, device=device) * 0.1, n_group=1, topk_group=1, top_k=top_k,
                      norm_topk_prob=True, scaling=2.5)  # fmt: skip
    table = []
    for n in args.tokens:
        x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
        timer = lambda call: time_graph(call, rep_ms=args.rep_ms).median_us  # noqa: E731
        for r in compare(x, weight, route_args, candidates, timer):
            name = "default" if r["candidate"] is None else ",".join(str(v) for v in r["candidate"])
            table.append([n, name, f"{r['us']:.1f}", f"{r['route_us']:.1f}", r["same"]])
            print(table[-1], flush=True)
    default = moe_router.logit_launch(hidden, experts)
    title = (f"Router matmul launches, {torch.cuda.get_device_name(device)}, {utc_stamp()}, E {experts}, "
             f"H {hidden}; default {default}")  # fmt: skip
    heads = ["N", "BLOCK_E,BLOCK_K,warps[,chunk]", "matmul us", "route_hidden us", "bits equal default"]
    text = f"{title}\n\n" + markdown_table(heads, table)
    print(text)
    if os.environ.get("OUT"):
        name = "probe_router_launch_kimi.md" if args.kimi else "probe_router_launch.md"
        Path(os.environ["OUT"], name).write_text(text)


if __name__ == "__main__":
    main()
