"""Where a target forward's time goes: the scaled-down Kimi shape (bench e2e's target), one forward of
N tokens per request at batch B, profiled eagerly (kernel table, bench/timing.kernel_profile) and timed
as a CUDA graph replay (bench/timing.time_graph: the method of every benchmark, docs/results.md).

    python scripts/profile_decode.py [--batch 1] [--nodes 1] [--prefix 96]
"""

from __future__ import annotations

import argparse

import torch

from kdtree_engine.bench.e2e_small import kimi_small_config, random_target
from kdtree_engine.bench.forward_cost import forward_call
from kdtree_engine.bench.timing import kernel_profile, time_graph


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--prefix", type=int, default=96)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    model = random_target(kimi_small_config(), torch.device("cuda"))
    forward = forward_call(model, a.batch, a.nodes, a.prefix, impl=None)
    for _ in range(3):
        forward()
    prof = kernel_profile(forward)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"batch {a.batch} nodes {a.nodes}: {len(events)} kernels in one forward")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows))
    t = time_graph(forward, rep_ms=200)
    print(f"graph replay: {t.median_us:.0f} us per forward (20-80%: {t.q20_us:.0f}-{t.q80_us:.0f})")


if __name__ == "__main__":
    main()
