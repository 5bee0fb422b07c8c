"""Replaying a drop-in call as a CUDA graph when it repeats on the same buffers.

SGLang's DDTree worker calls the tree path eagerly every round, on buffers it allocated once. Eagerly,
each of our calls costs its Python checks and one host launch per kernel (tens of microseconds each),
which at small batches is more than the kernels' GPU time. So a call whose tensors (address, shape,
strides, dtype) and other arguments equal those of an earlier call is captured into a CUDA graph the
second time it is seen, and replayed from then on: one host launch for the whole call. A replay reads
its inputs from, and writes its outputs to, the same addresses as the captured call, so it does what an
eager call with those arguments would do; only calls whose outputs all go to caller buffers are
replayed (a tensor allocated inside a capture would be overwritten by the next replay).

Not used off CUDA, inside a capture (SGLang capturing our call: it runs eagerly into that graph), or
with KDTREE_ENGINE_SGLANG_GRAPHS=0. A capture synchronizes the device once; at most CAPACITY graphs are
kept (least recently used first out).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict

import torch

CAPACITY = 64
ENV = "KDTREE_ENGINE_SGLANG_GRAPHS"


def _arg_key(value):
    if isinstance(value, torch.Tensor):
        return (value.data_ptr(), value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, list):
        return tuple(_arg_key(v) for v in value)
    return value


class GraphCache:
    """Captured graphs by call key, with the call's return value (views of the caller's buffers)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.graphs: OrderedDict = OrderedDict()
        self.seen: OrderedDict = OrderedDict()

    def call(self, key, fn):
        hit = self.graphs.get(key)
        if hit is not None:
            self.graphs.move_to_end(key)
            hit[0].replay()
            return hit[1]
        if self.seen.pop(key, None) is None:  # first time: run eagerly (this also compiles the kernels)
            self.seen[key] = True
            if len(self.seen) > 4 * self.capacity:
                self.seen.popitem(last=False)
            return fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            result = fn()
        graph.replay()
        self.graphs[key] = (graph, result)
        if len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return result

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()


CACHE = GraphCache()


def replayed(*, device_arg: str, bypass=None):
    """Decorator: calls of the function on CUDA go through CACHE. `device_arg` names a tensor argument
    (keyword, or the first positional) whose device decides; bypass(args, kwargs) -> True runs eagerly
    (e.g. an output that the call would allocate)."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            probe = kwargs.get(device_arg, args[0] if args else None)
            eager = (
                not isinstance(probe, torch.Tensor)
                or not probe.is_cuda
                or os.environ.get(ENV) == "0"
                or torch.cuda.is_current_stream_capturing()
                or (bypass is not None and bypass(args, kwargs))
            )
            if eager:
                return fn(*args, **kwargs)
            key = (
                fn.__name__,
                tuple(_arg_key(a) for a in args),
                tuple((k, _arg_key(v)) for k, v in kwargs.items()),
            )
            return CACHE.call(key, lambda: fn(*args, **kwargs))

        return call

    return wrap
