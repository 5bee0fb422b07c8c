"""Our attention and FlashMLA on the same causal problem, launched inside an NVTX range "profile" for
a kernel profiler (issue 29: what ncu shows of ours against FlashMLA's). One point: b requests of
prefix s - t plus t new rows, h heads, a cache of 64-row pages in shuffled order (the only pages
FlashMLA reads); our plan with the lengths known (its own kernel choice, schedule and merge),
FlashMLA's dense bf16 decode with causal=True. Both outputs are checked against each other
before the launches.

    ncu --nvtx --nvtx-include "profile/" ... python scripts/probe_attention_ncu.py \
        --point 16,1,8,32768 --side ours
"""

import argparse

import torch

from kdtree_engine.attention import plan_attention
from kdtree_engine.bench import flashmla
from kdtree_engine.bench.attention import make_problem

SCALE, D_V = 576**-0.5, 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", required=True, help="b,t,h,s")
    parser.add_argument("--side", choices=("ours", "flashmla"), required=True)
    parser.add_argument("--warmup", type=int, default=3, help="calls before the profiled one")
    args = parser.parse_args()
    b, t, h, s = (int(x) for x in args.point.split(","))
    module = flashmla.load()
    if module is None:
        raise SystemExit("flash_mla is not importable (install the sgl-flash-mla wheel)")
    p = make_problem(b, t, h, s, flashmla.PAGE, torch.device("cuda"))
    q, kv, lengths, table = p["q"], p["kv"], p["lengths"], p["block_table"]
    plan = plan_attention(q, kv, lengths, softmax_scale=SCALE, d_v=D_V, block_table=table)
    peer = flashmla.causal_call(module, q, kv, lengths, table, SCALE, D_V)
    ours_out, _ = plan.run(q, kv)
    peer_out, _ = peer()
    diff = float((ours_out.float() - peer_out.float()).abs().max())
    print(f"point b={b} t={t} h={h} s={s}: our kernel {plan.kernel}, max |ours - FlashMLA| {diff:.4f}")
    call = (lambda: plan.run(q, kv)) if args.side == "ours" else peer
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
