"""The verify-attention points where the kdtree_mla backend misses issue 31's bar (5x SGLang's Triton extend
kernel everywhere, 10x from 4k prefixes), taken apart on the same inputs as `bench sglang`'s section:

- port_step: the port's compile with its dense mask, its metadata and the Triton extend kernel;
- step: the worker's compile without the mask, our metadata launch and one layer (plan + run);
- meta: our metadata launch alone (kernels/sglang_attention.py);
- run_hopper / run_triton: one later layer with each of our kernels (the plan made);
- kernel_hopper: the Hopper kernel alone (run_hopper without the merge of cut row blocks), and the
  host schedule it ran (tiles, per, units, cuts, groups); merge_alone: the merge launch alone on one
  kernel run's pieces (run_hopper - kernel_hopper - merge_alone: what the handoff between them costs);
- run_merge_r{R}w{W}: run_hopper with the merge launch's programs taking R rows with W warps (its own
  shape: one row, 2+ warps);
- run_cut{k}: the Hopper kernel and its merge with each row block cut into k pieces instead of the
  balanced schedule (k = 1: one program per row block, no merge), and its programs: whether fewer,
  longer programs without the merge beat the balanced schedule at these small points.

Timing: bench.timing.time_graph (CUDA-graph replays, L2 flushed, median). One json line per point, and
probe_misses.json in OUT_DIR. --points picks other points (h,t,prefix,batch each). --kernel-runs N
times nothing: it plans each point and runs the Hopper kernel alone N times, for a profiler (no port
needed), e.g. `ncu -k regex:_attention_kernel -s 1 -c 1 python scripts/probe_verify_misses.py OUT
--points 8,17,4096,16 --kernel-runs 2`.

    python scripts/probe_verify_misses.py OUT_DIR [--port .peers/sglang] [--points ...] [--kernel-runs N]
"""

import argparse
import json
import os

import torch

from kdtree_engine.bench.peers import load_sglang_port
from kdtree_engine.bench.sglang_extend import load_extend_attention
from kdtree_engine.bench.sglang_verify import D_V, SCALE, OursVerify, PortVerify, make_point
from kdtree_engine.bench.timing import time_graph

POINTS = [  # (h, t, prefix, b): the section's misses (docs/sglang.md), then two points that pass
    (8, 9, 1024, 16), (8, 17, 1024, 16), (8, 9, 4096, 16), (8, 17, 4096, 16), (8, 17, 8192, 16),
    (8, 33, 4096, 16), (64, 33, 1024, 1), (64, 33, 4096, 1), (8, 9, 1024, 64), (64, 9, 4096, 16),
]  # fmt: skip
CUTS = (1, 2, 3)  # the pieces per row block of the forced schedules timed beside the balanced one
MERGE_SHAPES = ((2, 4), (4, 4), (8, 8), (16, 8))  # (rows, warps) per program of the merge launch tried


def timed(f) -> float:
    """us per call of f: median of CUDA-graph replays (bench.timing.time_graph), rounded to 0.1."""
    return round(time_graph(f, rep_ms=40, warmup=2).median_us, 1)


def measure(extend, compile_fn, h: int, t: int, prefix: int, b: int) -> dict:
    pool, q, vis = make_point(h, t, prefix, b, torch.device("cuda"))
    port = PortVerify.make(extend, compile_fn, pool, q, vis, SCALE, D_V)
    row = dict(h=h, t=t, prefix=prefix, batch=b)
    want = port.step().float().reshape(b * t, -1)

    row["port_step_us"] = timed(port.step)
    for impl in ("hopper", "triton"):
        ours = OursVerify.make(pool, q, vis, SCALE, D_V, impl=impl)
        row[f"diff_{impl}"] = float((want - ours.step().float()).abs().max())
        if impl == "hopper":
            row["step_us"] = timed(lambda ours=ours: ours.worker_step(port))
            row["meta_us"] = timed(lambda ours=ours: ours.backend.init_forward_metadata(ours.forward_batch))
            ours.step()
            row.update(kernel_alone(ours))
        row[f"run_{impl}_us"] = timed(ours.run)
    row["step_x"] = round(row["port_step_us"] / row["step_us"], 2)
    return row


def hopper_call(ours: OursVerify) -> tuple:
    """(launch, problem, q, kv, out, lse) of ours' plan: the Hopper kernel's arguments alone."""
    plan = ours.backend.forward_metadata.plan
    p, launch = plan.problem, plan.launch
    q = ours.q.view(plan.q_shape).contiguous()
    kv = ours.backend._layer_cache(ours.layer, q.shape[-1])
    out = torch.empty(p.b, p.t, p.h, p.d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(p.b, p.t, p.h, dtype=torch.float32, device=q.device)
    return launch, p, q, kv, out, lse


def kernel_alone(ours: OursVerify) -> dict:
    """The Hopper kernel of ours' plan without its merge (time and schedule), then the plan's run with
    CUTS' forced schedules and, where the plan merges, MERGE_SHAPES' merge launches."""
    from kdtree_engine.kernels import mla_attention_hopper as hopper

    launch, p, q, kv, out, lse = hopper_call(ours)
    us = timed(lambda: hopper._launch_kernel(launch, p, q, kv, out, lse))
    row = {"kernel_hopper_us": us, "schedule": list(launch.host or ()), "merge": launch.merge}
    if launch.merge:  # the merge launch alone, on the pieces of one kernel run
        hopper._launch_kernel(launch, p, q, kv, out, lse)
        row["merge_alone_us"] = timed(lambda: hopper._launch_merge(launch, p, out, lse))
    for k in CUTS:
        forced = hopper.plan(p, q.device, ours.backend.forward_metadata.max_seqlen, forced=k)
        us = timed(lambda f=forced: hopper.run(f, p, q, kv, out, lse))
        row[f"run_cut{k}_us"], row[f"programs_cut{k}"] = us, forced.programs
    if launch.merge:
        row.update(merge_shapes(launch, p, q, kv, out, lse))
    return row


def kernel_runs(h: int, t: int, prefix: int, b: int, runs: int) -> None:
    """The point's plan, then `runs` eager launches of the Hopper kernel alone (for a profiler)."""
    from kdtree_engine.kernels import mla_attention_hopper as hopper

    pool, q, vis = make_point(h, t, prefix, b, torch.device("cuda"))
    ours = OursVerify.make(pool, q, vis, SCALE, D_V, impl="hopper")
    ours.step()
    call = hopper_call(ours)
    for _ in range(runs):
        hopper._launch_kernel(*call)
    torch.cuda.synchronize()
    print(json.dumps({"h": h, "t": t, "prefix": prefix, "batch": b, "runs": runs,
                      "schedule": list(call[0].host or ())}), flush=True)  # fmt: skip


def merge_shapes(launch, p, q, kv, out, lse) -> dict:
    """The plan's run (kernel + merge launch) with the merge's programs taking MERGE_SHAPES' rows and
    warps instead of its own shape (one row, 2+ warps), the pieces per round unchanged."""
    from kdtree_engine.kernels import mla_attention_hopper as hopper
    from kdtree_engine.kernels import mla_attention_merge as merge

    own = merge._round_shape
    row = {}
    try:
        for rows, warps in MERGE_SHAPES:
            merge._round_shape = lambda pieces, on_gpu, r=rows, w=warps: (r, own(pieces, on_gpu)[1], w)
            row[f"run_merge_r{rows}w{warps}_us"] = timed(lambda: hopper.run(launch, p, q, kv, out, lse))
    finally:
        merge._round_shape = own
    return row


def point_arg(text: str) -> tuple[int, int, int, int]:
    """A point from "h,t,prefix,batch"."""
    h, t, prefix, b = (int(x) for x in text.split(","))
    return h, t, prefix, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--port", default=".peers/sglang")
    parser.add_argument("--points", nargs="+", type=point_arg, default=POINTS, help="h,t,prefix,batch each")
    parser.add_argument("--kernel-runs", type=int, default=0, help="only run the Hopper kernel N times")
    args = parser.parse_args()
    if args.kernel_runs:
        for point in args.points:
            kernel_runs(*point, args.kernel_runs)
        return
    extend = load_extend_attention(args.port)
    compile_fn = load_sglang_port(args.port).kernels.compile_ddtree_tree_triton
    rows = []
    for point in args.points:
        rows.append(measure(extend, compile_fn, *point))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "probe_misses.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
