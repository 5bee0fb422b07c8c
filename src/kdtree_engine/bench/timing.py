"""The one timing harness of every benchmark (bench/*.py, scripts/*.py). The method, stated once:

GPU time (`time_graph`): the calls are run a few times on a side stream (compilation, autotuning,
workspaces), then captured once in a CUDA graph, and `graph.replay` is timed by
`triton.testing.do_bench`: CUDA events around each replay, replays repeated for `rep_ms` after 25 ms
of warm-up, the L2 cache flushed (a 256 MB buffer zeroed) before each replay, outside the events.
Reported per call: the median and the 20th / 80th percentiles, in microseconds. Host launch costs are
left out, as in a captured model step; the GPU time between the kernels of one replay is in.

Why the flush, for every benchmark: (1) the rooflines count bytes read from HBM at the measured copy
bandwidth; an unflushed replay of a working set under the GPU's L2 (tens of MB; kimi-nano's weights, a
batch-1 block of draft logits) reads it from the L2 and could beat its own roofline; (2) a sample does
not depend on what ran before it; (3) the flush keeps the GPU busy while the host enqueues the replay, so
no launch latency lands between the start event and the first kernel; (4) it is do_bench's own default
(Liger times with do_bench) and bench_kineto's (DeepGEMM, FlashMLA) where it offers the choice: our
figures compare with theirs. It errs on the slow side for small inputs the engine finds in the L2
(logits the drafter just wrote). Memory-bound kernels timed several calls per graph give each call
its own inputs (`fn` as a list, as bench attention does): the calls after the first miss the L2 too.

Host time (`time_host`): for paths that run on the CPU (reference builders, peers' host code, kernels in
the Triton interpreter) and for calls timed as an engine makes them, host launch costs included (bench
sglang): the wall clock (time.perf_counter) of `calls` back-to-back calls, median over `reps`
repetitions after one untimed repetition; with `sync`, that device is synchronized before and after each
repetition. It is labelled "host" in every table that uses it.

`device_copy_bandwidth`: bytes read + written per second by a 1 GiB device-to-device copy, timed with
`time_graph`: the rate at which a kernel that only reads could read, the rooflines' denominator.

`count_kernels`: the CUDA kernels (memcpy and memset included) of one eager call, from torch.profiler.

Whole-generation tokens/s (bench e2e) is neither: the wall clock of whole generate() calls, end to end
by definition.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

COPY_BYTES = 1 << 30  # the copy that measures the bandwidth: 20x the L2


@dataclass(frozen=True)
class Timing:
    """Microseconds per call: median and 20th / 80th percentiles over `samples` timed repetitions;
    `method`: "graph" (time_graph: GPU time of CUDA graph replays) or "host" (time_host: wall clock)."""

    median_us: float
    q20_us: float
    q80_us: float
    samples: int
    method: str


def _summary(per_call_us: Sequence[float], method: str) -> Timing:
    times = sorted(float(t) for t in per_call_us)
    q20, q80 = (times[0], times[0]) if len(times) < 2 else statistics.quantiles(times, n=5)[::3]
    # the exclusive method extrapolates past the samples when there are few (two far apart: q20 < 0)
    q20, q80 = max(q20, times[0]), min(q80, times[-1])
    return Timing(statistics.median(times), q20, q80, len(times), method)


def _calls(fn, calls: int) -> list[Callable[[], object]]:
    """fn (one callable or a non-empty sequence of them) as a list, after the argument checks."""
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(f"calls: expected an int >= 1, got {calls!r}")
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    if not fns or not all(callable(f) for f in fns):
        raise ValueError(f"fn: expected a callable or a non-empty list of callables, got {fn!r}")
    return fns


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")


class _NoFlush:
    """The active Triton driver, except that do_bench's L2 flush does nothing (flush_l2=False)."""

    def __init__(self, base) -> None:
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)

    def clear_cache(self, cache) -> None:
        pass


@contextlib.contextmanager
def _l2_flush(enabled: bool):
    """do_bench as it is (flush) or with its flush turned off, for the duration of the block."""
    if enabled:
        yield
        return
    from triton.runtime import driver

    active = driver.active
    driver.set_active(_NoFlush(active))
    try:
        yield
    finally:
        driver.set_active(active)


def capture_graph(fns: list, calls: int = 1, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """The calls warmed up on a side stream, then captured in one graph: each of `fns` in order,
    `calls` times (time_graph's capture; scripts/profile_decode.py profiles a replay of it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            for f in fns:
                f()
    return graph


def time_graph(
    fn: Callable[[], object] | Sequence[Callable[[], object]],
    *,
    calls: int = 1,
    rep_ms: float = 100.0,
    flush_l2: bool = True,
    warmup: int = 3,
) -> Timing:
    """GPU time per call of `fn` (the method in the module docstring): captured `calls` times in one CUDA
    graph after `warmup` eager runs, replays timed by triton.testing.do_bench for `rep_ms`, the L2
    flushed before each replay unless flush_l2=False. `fn` may be a list of callables (each on its own
    inputs): the graph holds each `calls` times and the time is per call of one of them. The calls must
    be capturable (no host reads of device values)."""
    fns = _calls(fn, calls)
    _positive("rep_ms", rep_ms)
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
    if not torch.cuda.is_available():
        raise ValueError("time_graph: needs a CUDA GPU (time_host times host code)")
    from triton.testing import do_bench

    graph = capture_graph(fns, calls, warmup)
    with _l2_flush(flush_l2):
        times_ms = do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="all")
    per_call = len(fns) * calls
    return _summary([t * 1e3 / per_call for t in times_ms], "graph")


def time_host(
    fn: Callable[[], object], *, calls: int = 1, reps: int = 5, sync: torch.device | str | None = None
) -> Timing:
    """Wall-clock microseconds per call of `fn` on the host (the method in the module docstring):
    `calls` back-to-back calls per repetition, median over `reps` repetitions after one untimed one;
    `sync`: a CUDA device to synchronize before and after each repetition (None: none)."""
    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {fn!r}")
    _calls(fn, calls)
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise ValueError(f"reps: expected an int >= 1, got {reps!r}")
    device = None if sync is None else torch.device(sync)
    if device is not None and device.type != "cuda":
        device = None  # nothing to wait for on the CPU

    def repetition() -> float:
        if device is not None:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device is not None:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e6 / calls

    repetition()
    return _summary([repetition() for _ in range(reps)], "host")


def device_copy_bandwidth(device: torch.device | str | None = None, nbytes: int = COPY_BYTES) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`, timed with time_graph
    (median): the best rate of a kernel that only reads, the rooflines' denominator."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), rep_ms=200).median_us
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


def kernel_profile(fn: Callable[[], object]) -> torch.profiler.profile:
    """torch.profiler's record (CUDA activity) of one eager call of fn."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def count_kernels(fn: Callable[[], object]) -> int:
    """The CUDA kernels (memcpy and memset included) that one eager call of fn launches."""
    prof = kernel_profile(fn)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


__all__ = [
    "Timing",
    "capture_graph",
    "count_kernels",
    "device_copy_bandwidth",
    "kernel_profile",
    "time_graph",
    "time_host",
]
