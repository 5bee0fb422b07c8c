"""Where a target forward's time goes: the scaled-down Kimi shape (bench e2e's target), one forward of
N tokens per request at batch B, profiled eagerly (kernel table) and timed as a CUDA graph replay."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from kdtree_engine.bench.e2e import kimi_small_config, random_target


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--prefix", type=int, default=96)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    model = random_target(kimi_small_config(), torch.device("cuda"))
    cache = model.new_cache(a.batch, a.prefix + a.nodes + 1)
    cache.kv.normal_()
    ids = torch.randint(0, 163840, (a.batch, a.nodes), device="cuda")

    def forward():
        cache.seqlens.fill_(a.prefix)
        return model(ids, cache, validate=False)

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"batch {a.batch} nodes {a.nodes}: {len(events)} kernels in one forward")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    ms = do_bench(graph.replay, rep=200, return_mode="median")
    print(f"graph replay: {ms * 1e3:.0f} us per forward")


if __name__ == "__main__":
    main()
