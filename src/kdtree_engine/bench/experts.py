"""Expert touch statistics: how many distinct routed experts one target forward reads per MoE layer,
as a function of the number N of tokens in that forward (part of `kdtree-engine bench e2e --target nano`).

Each MoE layer sends every token to k of its E routed experts. A forward over N tokens (a decode step:
N = 1; a DFlash verify: N = block size; a DDTree verify: N = budget + 1, per request) reads the weights
of every expert that at least one of its tokens chose. If each token chose a uniformly random k-subset,
independently of the others, one token misses a given expert with probability 1 - k/E, so the expected
number of distinct experts touched is

    U(N) = E * (1 - (1 - k/E) ** N)        U(1) = k,  U(N) -> E as N grows.

Why it matters: a large MoE target is bound by weight reads at small batch, and its routed experts are
most of its weights (Kimi-K2: E = 384, k = 8 per layer). A verify forward over N tokens reads every
touched expert once, so its cost follows the distinct experts touched, not N: under uniform routing a
DDTree verify of 64 nodes + root reads U(65) = 286 experts per layer against the decode step's 8, which
is why large trees lose on a random-weight target. A trained model routes related tokens (a tree's nodes
share their prefix, siblings are alternatives at one position) to correlated experts and touches fewer;
the measured count against U(N) is how much that correlation saves.

Measured with forward hooks: a pre-hook on the model opens a record per forward (its kind: "prefill"
when it asks for `logits_rows`, "verify" when it passes a tree `visibility` mask, "decode" otherwise)
and a hook on every `Router` stores the expert ids it chose in that forward, per MoE layer. Hooks do
not run under CUDA graph replay, so the runs are eager (`cuda_graphs=False`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial

import torch

from kdtree_engine.bench.plot import markdown_table
from kdtree_engine.impl import capturing
from kdtree_engine.model.moe import Router


def uniform_touched(experts: int, top_k: int, tokens: float) -> float:
    """U(N) = E (1 - (1 - k/E)^N): the expected distinct experts that N tokens touch when each token
    picks a uniformly random set of k of the E experts, independently of the others."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass
class ForwardTouches:
    """One target forward: its kind ("prefill", "decode" or "verify"), batch rows, new tokens per row,
    and per MoE layer (in layer order) the sorted distinct expert ids its routers chose."""

    kind: str
    batch: int
    tokens: int
    experts: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def distinct(self) -> list[int]:
        return [len(ids) for ids in self.experts]


def _forward_kind(arguments: dict) -> str:
    if arguments.get("visibility") is not None:
        return "verify"
    return "prefill" if arguments.get("logits_rows") is not None else "decode"


class ExpertTouches:
    """A context manager that records, for every forward of `model` inside it, the routed experts each
    MoE layer chose (`forwards`: a list of ForwardTouches). Eager forwards only: a router that runs
    while a CUDA graph is captured raises (its ids are read on the host)."""

    def __init__(self, model) -> None:
        self.model = model
        self.routers = [(name, m) for name, m in model.named_modules() if isinstance(m, Router)]
        self.forwards: list[ForwardTouches] = []
        self._signature = inspect.signature(model.forward)
        self._handles: list = []

    def __enter__(self) -> ExpertTouches:
        self._handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        for slot, (_, router) in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(partial(self._record, slot)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _begin(self, module, args, kwargs) -> None:
        arguments = self._signature.bind(*args, **kwargs).arguments
        batch, tokens = arguments["input_ids"].shape
        empty = [()] * len(self.routers)
        self.forwards.append(ForwardTouches(_forward_kind(arguments), int(batch), int(tokens), empty))

    def _record(self, slot: int, module, args, output) -> None:
        ids = output[1]  # [rows, k]
        if capturing(ids.device):
            raise RuntimeError(
                "ExpertTouches: routers ran under CUDA graph capture; run with cuda_graphs=False"
            )
        if not self.forwards:
            raise RuntimeError("ExpertTouches: a router ran outside a forward of the model")
        self.forwards[-1].experts[slot] = tuple(ids.unique().tolist())


def summarize(forwards: list[ForwardTouches], kind: str, experts: int, top_k: int) -> dict:
    """The forwards of one kind: how many, mean tokens per forward (all rows), distinct experts per MoE
    layer (mean over layers and forwards; min and max over layers of the per-layer means) and U(N)
    averaged over the same forwards."""
    chosen = [f for f in forwards if f.kind == kind]
    if not chosen:
        raise ValueError(f"no {kind} forward was recorded")
    counts = torch.tensor([f.distinct for f in chosen], dtype=torch.float64)  # [forwards, layers]
    per_layer = counts.mean(0)
    tokens = [f.batch * f.tokens for f in chosen]
    uniform = sum(uniform_touched(experts, top_k, n) for n in tokens) / len(tokens)
    mean = float(counts.mean())
    return {
        "forwards": len(chosen),
        "tokens": sum(tokens) / len(tokens),
        "distinct_mean": mean,
        "distinct_min_layer": float(per_layer.min()),
        "distinct_max_layer": float(per_layer.max()),
        "uniform": uniform,
        "measured_over_uniform": mean / uniform,
    }


def touch_rows(target, drafter, prompts, budgets, new_tokens: int, impl=None) -> list[dict]:
    """Batch 1, greedy, eager: every prompt alone through autoregressive decoding (its decode forwards,
    N = 1), DFlash (N = block size) and DDTree at each budget (N = budget + 1); one row per method
    with summarize()'s fields over its decode or verify forwards (the prefill is left out)."""
    from kdtree_engine.engine import GenerationConfig, generate

    c = target.config
    e, k = c.n_routed_experts, c.num_experts_per_tok
    runs = [("autoregressive", None), ("dflash", None)] + [("ddtree", b) for b in budgets]
    rows = []
    for method, budget in runs:
        config = GenerationConfig(
            max_new_tokens=new_tokens, method=method, budget=budget, impl=impl, cuda_graphs=False
        )
        speculative = method != "autoregressive"
        with ExpertTouches(target) as touches:
            for prompt in prompts:
                generate(target, drafter if speculative else None, [prompt], config, stage_timing=False)
        block = drafter.block_size if speculative else 1
        stats = summarize(touches.forwards, "verify" if speculative else "decode", e, k)
        layers = len(touches.routers)
        rows.append({"method": method, "budget": config.tree_budget(block), "experts": e, "top_k": k,
                     "moe_layers": layers, **stats})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    """The touch table, under a line that states E, k and the layers."""
    first = rows[0]
    intro = (
        f"Distinct routed experts a target forward touches per MoE layer (batch 1, greedy, eager; "
        f"E = {first['experts']} routed experts, k = {first['top_k']} per token, {first['moe_layers']} MoE "
        f"layers). Uniform: E (1 - (1 - k/E)^N), the expectation if each token picked k experts at random:"
    )
    heads = ["method", "budget", "N tokens", "forwards", "distinct / layer", "min layer", "max layer",
             "uniform", "measured / uniform"]  # fmt: skip
    body = [
        [r["method"], r["budget"] if r["method"] != "autoregressive" else "-", f"{r['tokens']:.1f}",
         r["forwards"], f"{r['distinct_mean']:.2f}", f"{r['distinct_min_layer']:.2f}",
         f"{r['distinct_max_layer']:.2f}", f"{r['uniform']:.2f}", f"{r['measured_over_uniform']:.2f}"]
        for r in rows
    ]  # fmt: skip
    return intro + "\n\n" + markdown_table(heads, body)


__all__ = ["ExpertTouches", "ForwardTouches", "markdown", "summarize", "touch_rows", "uniform_touched"]
