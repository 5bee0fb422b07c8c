"""A Runner's prefill as CUDA graphs: one per padded prompt width, captured after its first (eager)
prefill, as a serving engine captures its shapes. An eager prefill of a small model is host-bound
(each of its launches costs the host more than the device), and a call pays it once, before its first
round; replayed, it costs what its kernels cost.

The prompts of a call are padded to a width of the Runner's (`prefill_width`: the longest prompt's
length rounded up to a power of two, at least MIN_WIDTH, at most the Runner's prompt_len), so that a
few graphs serve every call. Padding rows sit after each prompt's last real row: causal attention keeps
them from every real row, and the cache's lengths are the prompts' own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_WIDTH = 16  # the narrowest padded prompt width


def prefill_width(longest: int, prompt_len: int) -> int:
    """The padded width of a call whose longest prompt has `longest` tokens, for a Runner of prompts up
    to `prompt_len`: the least power of two >= longest and >= MIN_WIDTH, capped at prompt_len."""
    width = MIN_WIDTH
    while width < longest:
        width *= 2
    return max(longest, min(width, prompt_len))


def prefill_forward(run, cache, ids: torch.Tensor, lens: torch.Tensor, validate: bool = True):
    """The target's forward over padded prompts ids [B, T] of lengths lens [B] into `cache` (empty):
    the drafter's target layers captured, the logits of each prompt's last real row."""
    return run.target(ids, cache, lengths=lens, capture_layers=run.capture, impl=run.impl,
                      logits_rows=lens - 1, row_invariant=run.config.row_invariant,
                      validate=validate)  # fmt: skip


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, T] the graph's input ids, written before each replay
    lens: torch.Tensor  # [B] the graph's prompt lengths
    out: object  # the graph's ForwardOutput (logits, hidden), overwritten by each replay

    def run(self, ids: torch.Tensor, lens: torch.Tensor):
        self.ids.copy_(ids)
        self.lens.copy_(lens)
        self.graph.replay()
        return self.out


class PrefillGraphs:
    """A Runner's prefill graphs, keyed by padded width, in one memory pool."""

    def __init__(self) -> None:
        self.graphs: dict[int, _PrefillGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def get(self, width: int) -> _PrefillGraph | None:
        return self.graphs.get(width)

    def capture(self, run, cache, ids: torch.Tensor, lens: torch.Tensor) -> None:
        """Captures the prefill of ids' width (after an eager prefill of that width: kernels compiled)
        on static copies of ids and lens. Recording runs nothing: the cache is not written, and the
        outputs hold zeros until the first replay (the first draft's stage is captured over them after
        the call, before any replay)."""
        ids, lens = ids.clone(), lens.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = prefill_forward(run, cache, ids, lens, validate=False)
        for t in (out.logits, out.hidden):  # defined until the first replay (a draft may read them)
            if t is not None:
                t.zero_()
        self.graphs[ids.shape[1]] = _PrefillGraph(graph, ids, lens, out)
