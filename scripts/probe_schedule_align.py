"""The Hopper attention kernel with its aligned schedule against the flat one, on the same inputs.

For each point (batch, heads, tree nodes, prefix) and page size (1: SGLang's token pool, its rows
scattered at random; 64: FlashMLA's pages) the attention of a random tree (ancestor bits) runs with
the schedule planned on the host twice: as `mla_attention_schedule.schedule` picks it (aligned where it
applies) and with ALIGN_SLACK = (0, 1) (never aligned: the flat cut). Timing: bench.timing.time_graph
(CUDA-graph replays, L2 flushed, median). Prints one line per point and writes probe_align.json.

    python scripts/probe_schedule_align.py OUT_DIR
"""

import argparse
import json
import os

import torch

from kdtree_engine.attention import plan_attention
from kdtree_engine.bench.timing import time_graph
from kdtree_engine.kernels import mla_attention_schedule as sched

POINTS = [
    (16, 8, 17, 1024), (16, 8, 17, 4096), (64, 8, 17, 4096), (16, 8, 17, 8192), (64, 8, 17, 8192),
    (64, 8, 33, 4096), (16, 8, 9, 4096), (16, 16, 17, 4096), (1, 64, 33, 4096), (16, 64, 9, 4096),
    (64, 8, 17, 32768), (1, 8, 17, 4096),
]  # fmt: skip
SCHEDULES = (("aligned", sched.ALIGN_SLACK), ("flat", (0, 1)))


def tree_bits(t: int) -> list[int]:
    """Ancestor bits of a random tree of t nodes (node 0 the root, each node's parent before it)."""
    bits = [1]
    for i in range(1, t):
        parent = int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i)))
        bits.append((1 << i) | bits[parent])
    return bits


def inputs(b: int, h: int, t: int, s: int, page: int, gen: torch.Generator):
    n = s + t
    pages = -(-n // page)
    q = torch.randn(b, t, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(b * pages, page, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(b * pages, device="cuda", generator=gen).view(b, pages).to(torch.int32)
    bits = torch.tensor(tree_bits(t), dtype=torch.int64, device="cuda").expand(b, t).contiguous()
    return q, kv, table, bits, torch.full((b,), n, dtype=torch.int32, device="cuda")


def measure(point: tuple, page: int, gen: torch.Generator) -> dict:
    b, h, t, s = point
    q, kv, table, bits, lens = inputs(b, h, t, s, page, gen)
    row = dict(page=page, b=b, h=h, t=t, s=s, cache_mb=kv.numel() * 2 / 1e6)
    outs = {}
    for name, slack in SCHEDULES:
        sched.ALIGN_SLACK = slack
        plan = plan_attention(q, kv, lens, softmax_scale=0.04, ancestor_bits=bits, block_table=table,
                              max_seqlen=s + t, validate=False)  # fmt: skip
        outs[name] = plan.run(q, kv)[0].float()
        row[f"{name}_us"] = time_graph(lambda plan=plan: plan.run(q, kv), rep_ms=40).median_us
        row[f"{name}_schedule"] = list(plan.launch.host)
        row["kernel"] = plan.kernel
    sched.ALIGN_SLACK = SCHEDULES[0][1]
    row["max_diff"] = (outs["aligned"] - outs["flat"]).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for probe_align.json")
    out = parser.parse_args().out
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for page in (1, 64):
        for point in POINTS:
            r = measure(point, page, gen)
            rows.append(r)
            gain = r["flat_us"] / r["aligned_us"]
            print(f"page {page:2d} b {r['b']:2d} h {r['h']:2d} t {r['t']:2d} s {r['s']:5d}: aligned "
                  f"{r['aligned_us']:8.1f} us, flat {r['flat_us']:8.1f} us, x{gain:.2f}, "
                  f"diff {r['max_diff']:.1e}, schedule {r['aligned_schedule']}", flush=True)  # fmt: skip
    with open(os.path.join(out, "probe_align.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
