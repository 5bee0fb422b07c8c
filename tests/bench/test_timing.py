"""bench/timing.py, the one timing harness: the host timer and the argument checks on the CPU; on CUDA
(gpu) graph times that are positive, finite, per call, and longer for a graph of two calls than one."""

from __future__ import annotations

import math
import time

import pytest
import torch

from kdtree_engine.bench import timing


def _finite(t: timing.Timing) -> bool:
    return all(math.isfinite(v) and v > 0 for v in (t.median_us, t.q20_us, t.q80_us))


# --- the host timer -----------------------------------------------------------------------------------


def test_host_timer_calls_and_statistics():
    calls = []
    t = timing.time_host(lambda: calls.append(1), calls=3, reps=4)
    assert len(calls) == 3 * (1 + 4)  # one untimed repetition, then `reps` timed ones
    assert t.method == "host" and t.samples == 4
    assert _finite(t) and t.q20_us <= t.median_us <= t.q80_us


def test_host_timer_measures_per_call_wall_time():
    t = timing.time_host(lambda: time.sleep(0.002), calls=2, reps=3)
    assert 2000 <= t.median_us < 200_000  # at least the sleep, per call (not per repetition)


def test_host_timer_sync_on_the_cpu_is_a_no_op():
    t = timing.time_host(lambda: torch.ones(4).sum(), reps=2, sync="cpu")
    assert _finite(t) and t.samples == 2


def test_summary_median_and_quantiles():
    t = timing._summary([5.0, 1.0, 3.0, 2.0, 4.0], "graph")
    assert (t.median_us, t.samples, t.method) == (3.0, 5, "graph")
    assert t.q20_us == pytest.approx(1.2) and t.q80_us == pytest.approx(4.8)
    one = timing._summary([7.0], "host")
    assert (one.median_us, one.q20_us, one.q80_us) == (7.0, 7.0, 7.0)
    two = timing._summary([1.0, 30.0], "host")  # quantiles stay within the samples
    assert (two.q20_us, two.q80_us) == (1.0, 30.0)


# --- argument checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("calls", [0, -1, 1.5, True, "2"])
def test_calls_must_be_a_positive_int(calls):
    with pytest.raises(ValueError, match="^calls: expected an int >= 1"):
        timing.time_host(lambda: None, calls=calls)
    with pytest.raises(ValueError, match="^calls: expected an int >= 1"):
        timing.time_graph(lambda: None, calls=calls)


@pytest.mark.parametrize("reps", [0, -3, 2.0, None])
def test_reps_must_be_a_positive_int(reps):
    with pytest.raises(ValueError, match="^reps: expected an int >= 1"):
        timing.time_host(lambda: None, reps=reps)


@pytest.mark.parametrize("fn", [None, 3, [], [lambda: None, "x"]])
def test_graph_fn_must_be_callables(fn):
    with pytest.raises(ValueError, match="^fn: expected a callable or a non-empty list"):
        timing.time_graph(fn)


def test_host_fn_must_be_one_callable():
    with pytest.raises(ValueError, match="^fn: expected a callable"):
        timing.time_host([lambda: None])


@pytest.mark.parametrize("rep_ms", [0, -1.0, float("nan"), True])
def test_rep_ms_must_be_positive(rep_ms):
    with pytest.raises(ValueError, match="^rep_ms: expected a number > 0"):
        timing.time_graph(lambda: None, rep_ms=rep_ms)


def test_warmup_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="^warmup: expected an int >= 0"):
        timing.time_graph(lambda: None, warmup=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message without CUDA")
def test_graph_timer_needs_cuda():
    with pytest.raises(ValueError, match="time_graph: needs a CUDA GPU"):
        timing.time_graph(lambda: None)
    with pytest.raises(ValueError, match="^device: expected a CUDA device"):
        timing.device_copy_bandwidth("cpu")


# --- on CUDA ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_graph_time_is_positive_finite_per_call():
    x = torch.randn(1 << 22, device="cuda")
    t = timing.time_graph(lambda: x.mul_(1.0), rep_ms=20)
    assert t.method == "graph" and t.samples >= 1 and _finite(t)
    assert t.q20_us <= t.median_us <= t.q80_us


@pytest.mark.gpu
def test_a_graph_of_two_calls_takes_longer_than_one():
    src = torch.randn(1 << 25, device="cuda")  # 128 MB: each call reads from HBM whatever the L2 holds
    dst = torch.empty_like(src)
    one = timing.time_graph(lambda: dst.copy_(src), rep_ms=30)
    two = timing.time_graph(lambda: dst.copy_(src), calls=2, rep_ms=30)
    assert 2 * two.median_us > 1.5 * one.median_us  # times are per call: the graph of two takes longer
    assert two.median_us == pytest.approx(one.median_us, rel=0.3)
    pair = timing.time_graph([lambda: dst.copy_(src), lambda: src.copy_(dst)], rep_ms=30)
    assert pair.median_us == pytest.approx(one.median_us, rel=0.3)  # a list: per call of one of them


@pytest.mark.gpu
def test_unflushed_timing_restores_the_driver():
    from triton.runtime import driver

    before = driver.active
    x = torch.randn(1 << 16, device="cuda")
    t = timing.time_graph(lambda: x.add_(1.0), rep_ms=10, flush_l2=False)
    assert _finite(t) and driver.active is before


@pytest.mark.gpu
def test_copy_bandwidth_and_kernel_count():
    bw = timing.device_copy_bandwidth(nbytes=1 << 28)
    assert 1e10 < bw < 1e14  # bytes read + written per second: tens of GB/s to tens of TB/s
    x = torch.randn(1024, device="cuda")
    assert timing.count_kernels(lambda: (x + 1) * 2) == 2
