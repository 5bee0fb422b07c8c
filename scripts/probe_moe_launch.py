"""The MoE kernels' launch shapes tried side by side (issue 27): for each token count N of the
scaled-down Kimi shape's MoE layer (bench e2e's 2.5B target: E = 32 routed experts of I = 768, k = 6, one
shared expert, H = 2048), the GPU time of one `kernels.moe.moe_experts` call (bench/timing.time_graph:
CUDA-graph replays, the L2 flushed before each, medians) with its default launch and with one kernel's
blocks replaced by a candidate (gate_up or down; the other kernel keeps its default), and the rate at
which it streams the weights of the experts its routing touched. Every candidate's output is compared
with the default's (bits: the candidates keep BLOCK_M and BLOCK_K, so the reduction order is the same).
Prints a markdown table and writes it under $OUT when OUT is set.

    python scripts/probe_moe_launch.py [--tokens 1 33] [--candidates 32,128,4,4 16,128,4,4]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.kernels import moe

EXPERTS, TOP_K, HIDDEN, INTER = 32, 6, 2048, 768


def parse_blocks(text: str) -> moe.Blocks:
    """'block_n,block_k,warps,stages' -> Blocks (ValueError naming --candidates otherwise)."""
    try:
        return moe.Blocks(*(int(v) for v in text.split(",")))
    except (TypeError, ValueError):
        raise ValueError(f"--candidates: expected n,k,warps,stages, got {text!r}") from None


def blocks_text(blocks: moe.Blocks) -> str:
    return ",".join(str(v) for v in dataclasses.astuple(blocks))


@contextlib.contextmanager
def forced(kernel: str | None, blocks: moe.Blocks | None):
    """Launches chosen inside take `blocks` for `kernel` ("gate_up" or "down"); None: the default."""
    chosen = moe.launch_config

    def launch_config(n_assign, n_experts, itemsize):
        base = chosen(n_assign, n_experts, itemsize)
        if kernel == "gate_up":
            return moe.Launch(base.block_m, blocks, base.down)
        if kernel == "down":
            return moe.Launch(base.block_m, base.gate_up, blocks)
        return base

    moe.launch_config = launch_config
    try:
        yield
    finally:
        moe.launch_config = chosen


def make_layer(tokens: int, device: torch.device, seed: int = 0) -> dict:
    """One MoE layer's inputs: uniform random top-k routing of `tokens` tokens, random bf16 weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, generator=gen, **bf16)
    ids = torch.rand(tokens, EXPERTS, generator=gen, device=device).argsort(dim=-1)[:, :TOP_K]
    weights = torch.rand(tokens, TOP_K, generator=gen, device=device)
    w_gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, **bf16) * HIDDEN**-0.5
    w_down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, **bf16) * INTER**-0.5
    shared = tuple(
        torch.randn(*s, generator=gen, **bf16) * 0.02 for s in ((INTER, HIDDEN),) * 2 + ((HIDDEN, INTER),)
    )
    touched = int(ids.unique().numel()) + 1  # the shared expert
    return dict(args=(x, weights, ids, w_gate_up, w_down, shared), bytes=touched * 3 * INTER * HIDDEN * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 17, 33, 65])
    parser.add_argument("--candidates", nargs="+", default=["16,128,4,4", "32,128,4,4", "32,128,4,6",
                                                           "64,128,8,4", "128,128,4,3"])  # fmt: skip
    parser.add_argument("--rep-ms", type=float, default=50)
    args = parser.parse_args()
    try:
        candidates = [parse_blocks(c) for c in args.candidates]
    except ValueError as exc:
        parser.exit(2, f"probe_moe_launch: {exc}\n")
    if not torch.cuda.is_available():
        parser.exit(2, "probe_moe_launch: needs a CUDA GPU\n")
    from kdtree_engine.bench.timing import time_graph

    device = torch.device("cuda")
    table = []
    for n in args.tokens:
        layer = make_layer(n, device)
        base = moe.moe_experts(*layer["args"])
        default = moe.launch_config(n * TOP_K, EXPERTS, 2)
        for kernel, blocks in [(None, None)] + [(k, c) for k in ("gate_up", "down") for c in candidates]:
            with forced(kernel, blocks):
                out = moe.moe_experts(*layer["args"])
                us = time_graph(lambda a=layer["args"]: moe.moe_experts(*a), rep_ms=args.rep_ms).median_us
            same = bool(torch.equal(out, base))
            name = "default" if kernel is None else f"{kernel} {blocks_text(blocks)}"
            table.append(
                [n, f"{default.block_m}", name, f"{us:.1f}", f"{layer['bytes'] / us * 1e-6:.2f}", same]
            )
            print(table[-1], flush=True)
    header = ["N", "BLOCK_M", "launch", "us", "TB/s of touched weights", "bits equal default"]
    title = f"MoE launch shapes, {torch.cuda.get_device_name(device)}, {utc_stamp()}, bf16"
    shape = f"E {EXPERTS}, k {TOP_K}, H {HIDDEN}, I {INTER}, one shared expert"
    text = f"{title}, {shape}\n\n" + markdown_table(header, table)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_moe_launch.md").write_text(text)


if __name__ == "__main__":
    main()
