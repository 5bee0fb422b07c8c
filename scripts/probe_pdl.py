"""What programmatic dependent launch (PDL) would save in a captured forward (issue 27): a chain of
dependent Triton launches, each reading its predecessor's output, captured in one CUDA graph and timed
by bench/timing.time_graph (CUDA-graph replays, the L2 flushed, medians; time per launch), launched
(a) plainly, (b) with PDL and `griddepcontrol.wait` first thing in every program, (c) as (b) plus
`launch_dependents` right after the wait, (d) as (c) but each program's independent loads (its weight
slice) issued before the wait. Two kinds of launch: "tiny" (a norm-like row kernel over one 2048-wide
row: launch-bound, as the forward's rmsnorm, rope, route, combine launches) and "weight" (a GEMV-like
kernel reading a `--weight-mb` MB weight in 128 programs, as a small projection). Every variant's final
output is checked equal to the plain chain's.

    python scripts/probe_pdl.py [--launches 48] [--weight-mb 6]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kdtree_engine.bench.plot import markdown_table, utc_stamp

WIDTH = 2048


@triton.jit
def _tiny_kernel(x_ptr, y_ptr, WAIT: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    """y = x * rsqrt(mean(x^2) + 1) + 1 over one row of BLOCK floats."""
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / BLOCK + 1.0) + 1.0
    tl.store(y_ptr + offs, y)


@triton.jit
def _weight_kernel(x_ptr, w_ptr, y_ptr, K, WAIT: tl.constexpr, TRIGGER: tl.constexpr, EARLY: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """y[cols] = tanh(W[cols] . x) for this program's BLOCK_N columns; x [K] float32, W [N, K] bf16.
    EARLY: the whole weight slice is loaded before the wait (it does not depend on the predecessor)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    if EARLY:
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :]).to(tl.float32)
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    if not EARLY:
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :]).to(tl.float32)
    x = tl.load(x_ptr + ks)
    acc += tl.sum(w * x[None, :], axis=1)
    # the next launch reads y as its x: keep the values bounded
    y = 2.0 / (1.0 + tl.exp(-2.0 * acc)) - 1.0
    tl.store(y_ptr + cols, y)


VARIANTS = {  # name: (pdl, wait, trigger, early)
    "plain": (False, False, False, False),
    "PDL, wait": (True, True, False, False),
    "PDL, wait + trigger": (True, True, True, False),
    "PDL, early loads + wait + trigger": (True, True, True, True),
}


def tiny_chain(launches: int, variant: str, device):
    pdl, wait, trigger, _ = VARIANTS[variant]
    bufs = [torch.full((WIDTH,), 0.5, device=device)] + [
        torch.empty(WIDTH, device=device) for _ in range(launches)
    ]

    def run():
        for i in range(launches):
            _tiny_kernel[(1,)](bufs[i], bufs[i + 1], WAIT=wait, TRIGGER=trigger, BLOCK=WIDTH, launch_pdl=pdl,
                               num_warps=4)  # fmt: skip
        return bufs[-1]

    return run


def weight_chain(launches: int, weight_mb: float, variant: str, device):
    """Each launch: 128 programs; W [128 * BLOCK_N, K] with K = 1024 bf16 columns per row read at once."""
    pdl, wait, trigger, early = VARIANTS[variant]
    k, programs = 1024, 128
    block_n = max(1, int(weight_mb * 2**20 / (2 * k * programs)))
    block_n = triton.next_power_of_2(block_n) // (2 if triton.next_power_of_2(block_n) > block_n else 1)
    n = programs * block_n
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [(torch.randn(n, k, device=device, generator=gen) * k**-0.5).bfloat16() for _ in range(launches)]
    # zeros: where N < K a launch reads K values of which its predecessor wrote N (the rest stays 0)
    bufs = [torch.randn(max(n, k), device=device, generator=gen)] + [torch.zeros(max(n, k), device=device)
                                                                   for _ in range(launches)]  # fmt: skip

    def run():
        for i in range(launches):
            _weight_kernel[(programs,)](bufs[i], ws[i], bufs[i + 1], k, WAIT=wait, TRIGGER=trigger,
                                        EARLY=early, BLOCK_N=block_n, BLOCK_K=k, launch_pdl=pdl,
                                        num_warps=4)  # fmt: skip
        return bufs[-1]

    return run, n * k * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=48)
    parser.add_argument("--weight-mb", type=float, default=6.0)
    parser.add_argument("--rep-ms", type=float, default=30.0)
    args = parser.parse_args()
    if args.launches < 2 or args.weight_mb <= 0:
        parser.exit(2, "probe_pdl: --launches must be >= 2 and --weight-mb > 0\n")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        parser.exit(2, "probe_pdl: needs a CUDA GPU of compute capability 9.0 or more\n")
    from kdtree_engine.bench.timing import time_graph

    device = torch.device("cuda")
    table = []
    for kind in ("tiny", "weight"):
        want = None
        for variant in VARIANTS:
            if kind == "tiny":
                run, nbytes = tiny_chain(args.launches, variant, device), 0
            else:
                run, nbytes = weight_chain(args.launches, args.weight_mb, variant, device)
            got = run().clone()
            want = got if want is None else want
            us = time_graph(run, rep_ms=args.rep_ms).median_us / args.launches
            base = us if variant == "plain" else base  # noqa: F821 - plain runs first
            rate = f"{nbytes / us / 1e3:.0f}" if nbytes else "-"
            table.append(
                [kind, variant, f"{us:.2f}", f"{us / base:.2f}x", rate, bool(torch.equal(got, want))]
            )
            print(table[-1], flush=True)
    title = (
        f"PDL in a captured chain of {args.launches} launches, {torch.cuda.get_device_name()}, {utc_stamp()}"
    )
    heads = ["launch", "variant", "us per launch", "/ plain", "GB/s", "same result"]
    text = f"{title}\n\n" + markdown_table(heads, table) + "\n"
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_pdl.md").write_text(text)


if __name__ == "__main__":
    main()
