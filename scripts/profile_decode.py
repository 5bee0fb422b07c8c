"""Where a target forward's time goes: the scaled-down Kimi shape (bench e2e's target), one forward of
N tokens per request at batch B, profiled eagerly (kernel table, bench/timing.kernel_profile) and timed
as a CUDA graph replay (bench/timing.time_graph: the method of every benchmark, docs/results.md). With
--graph, the replay itself is profiled too: the kernels' summed time inside one replay against the replay's
time, the difference being the gaps between dependent launches in the graph. With programmatic dependent
launch on (kernels/_pdl.py, the default on compute capability 9.0+) a kernel starts before its
predecessor ends and waits for it, so its profiled time includes that wait and the kernels' sum exceeds
the replay's span; KDTREE_ENGINE_PDL=0 gives each kernel's own time.

    python scripts/profile_decode.py [--batch 1] [--nodes 1] [--prefix 96] [--graph]
"""

from __future__ import annotations

import argparse

import torch

from kdtree_engine.bench.e2e_small import kimi_small_config, random_target
from kdtree_engine.bench.forward_cost import forward_call
from kdtree_engine.bench.timing import capture_graph, kernel_profile, time_graph


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--prefix", type=int, default=96)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--graph", action="store_true", help="also profile one replay of the captured forward")
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
    if a.graph:
        print_replay_profile(forward, a.rows)


def print_replay_profile(forward, rows: int) -> None:
    """Kernels of one replay of the forward captured in a CUDA graph: their summed GPU time against the
    span from the first kernel's start to the last one's end (the gaps: launch latency inside the graph)."""
    graph = capture_graph([forward])
    for _ in range(3):
        graph.replay()
    prof = kernel_profile(graph.replay)
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    if not events:
        print("graph replay profile: no kernel events recorded")
        return
    busy = sum(e.time_range.elapsed_us() for e in events)
    span = events[-1].time_range.end - events[0].time_range.start
    gaps = span - busy
    print(f"graph replay profile: {len(events)} kernels, {busy:.0f} us of kernel time in a {span:.0f} us "
          f"span ({gaps:.0f} us of gaps, {gaps / max(len(events) - 1, 1):.2f} us per launch)")  # fmt: skip
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))


if __name__ == "__main__":
    main()
