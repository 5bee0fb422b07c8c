"""What one target forward and one draft cost on the GPU, against their memory rooflines (part of
`kdtree-engine bench e2e`, both targets; CUDA only). Timed with bench/timing.py.

Per batch b and N new tokens per request (N = 1: a decode step, as the engine calls it; N = budget + 1:
a verify, a chain's visibility, the drafter's target layers captured as the engine asks) on a cache of
`prefix` rows per request:
- kernels: the CUDA kernels of one eager forward (timing.count_kernels), called as it is captured
  (validate=False, the bench's impl);
- experts: the distinct routed experts that forward touches per MoE layer (bench.experts.ExpertTouches,
  on a second eager forward of the same inputs: the captured replays route the same tokens the same way);
- us: the GPU time of the captured forward (timing.time_graph);
- bytes: what the forward cannot avoid moving: every weight except the embedding table and the routed
  experts, the embedding rows of its b N tokens, the routed experts it touched (per MoE layer), the cache
  rows it reads (prefix + N per request, every layer) and writes (N), each layer's input read and output
  written once, and the logits written as float32;
- roofline_us = bytes / the copy bandwidth measured in the same run (timing.device_copy_bandwidth).
The draft: one `drafter.draft()` (the engine's call) on a drafter cache holding `prefix` context rows
plus a round of block_size new context rows (5 of them real), captured and timed the same way, against
the decode step at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kdtree_engine.bench.experts import ExpertTouches
from kdtree_engine.bench.plot import markdown_table
from kdtree_engine.bench.timing import count_kernels, time_graph

ROUND_ROWS = 5  # real context rows per drafting round (accepted nodes + bonus), as a round of tau 5


def forward_bytes(model, batch: int, tokens: int, prefix: int, touched: Sequence[float]) -> dict:
    """Bytes one forward of `tokens` new tokens per request must move (the module docstring's list), by
    part: weights (all but the embedding table and routed experts, plus the embedding rows), experts
    (touched[i] routed experts in the i-th MoE layer), cache (read and written), activations."""
    c, item = model.config, model.dtype.itemsize
    rows = batch * tokens
    weights = rows * c.hidden_size * item + model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    per_expert: dict[int, float] = {}
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens.", "lm_head.")):
            continue
        size = p.numel() * p.element_size()
        if ".experts." in name:
            layer = int(name.split(".")[1])
            per_expert[layer] = per_expert.get(layer, 0.0) + size / c.n_routed_experts
        else:
            weights += size
    if len(touched) != len(per_expert):
        raise ValueError(f"touched: expected {len(per_expert)} MoE layers, got {len(touched)}")
    experts = sum(per_expert[layer] * n for layer, n in zip(sorted(per_expert), touched))
    cache = c.num_hidden_layers * batch * (prefix + 2 * tokens) * c.latent_dim * item
    activations = 2 * c.num_hidden_layers * rows * c.hidden_size * item + rows * c.vocab_size * 4
    parts = {"weights": weights, "experts": experts, "cache": cache, "activations": activations}
    return {k: float(v) for k, v in parts.items()} | {"total": float(sum(parts.values()))}


def forward_call(
    model, batch: int, tokens: int, prefix: int, impl: str | None, capture: Sequence[int] = ()
) -> Callable[[], object]:
    """A callable running one target forward of `tokens` random tokens per request on a cache of
    `prefix` random rows per request (the cache length reset first, so that every call is the same)."""
    dev = model.device
    cache = model.new_cache(batch, prefix + tokens + 1)
    cache.kv.normal_()
    gen = torch.Generator(device=dev).manual_seed(batch * 1000 + tokens)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=dev, generator=gen)
    vis = None
    if tokens > 1:  # a verify: a chain, every node seeing the ones before it
        vis = torch.ones(tokens, tokens, dtype=torch.bool, device=dev).tril().expand(batch, tokens, tokens)
    layers = tuple(capture) if tokens > 1 else ()

    def forward():
        cache.seqlens.fill_(prefix)
        return model(ids, cache, visibility=vis, capture_layers=layers, impl=impl, validate=False)

    return forward


def forward_cost(
    model, batch: int, tokens: int, prefix: int, impl: str | None, copy_bw: float, capture: Sequence[int] = ()
) -> dict:
    """One forward's kernels, touched experts, GPU time and roofline (module docstring): a row."""
    forward = forward_call(model, batch, tokens, prefix, impl, capture)
    forward()  # compile outside the profile
    kernels = count_kernels(forward)
    with ExpertTouches(model) as touches:
        forward()
    distinct = touches.forwards[-1].distinct
    if any(n == 0 for n in distinct):  # a router that did not run as a module: no count, no roofline
        raise RuntimeError(f"forward_cost: no routed expert recorded in some MoE layer ({distinct})")
    us = time_graph(forward).median_us
    nbytes = forward_bytes(model, batch, tokens, prefix, distinct)
    roof_us = nbytes["total"] / copy_bw * 1e6
    experts = sum(distinct) / len(distinct) if distinct else 0.0
    return {"batch": batch, "stage": "decode" if tokens == 1 else "verify", "tokens": tokens,
            "kernels": kernels, "us": us, "roofline_us": roof_us, "over_roofline": us / roof_us,
            "experts_per_layer": experts, "bytes": nbytes, "copy_GBps": copy_bw / 1e9}  # fmt: skip


def draft_call(
    drafter, target, batch: int, context: int, impl: str | None
) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """(reset, draft): a drafter cache holding `context` rows per request and one round's inputs
    (block_size new context rows of which ROUND_ROWS are real, the bonus token after them); reset()
    puts the cache length back, draft() drafts that round (the engine's call)."""
    dev, width = target.device, len(drafter.target_layer_ids) * target.config.hidden_size
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = drafter.new_cache(batch, context + 2 * drafter.block_size)
    prefix = torch.randn(batch, context, width, device=dev, dtype=target.dtype, generator=gen)
    lens = torch.full((batch,), context, device=dev)
    bonus = torch.randint(0, target.config.vocab_size, (batch,), device=dev, generator=gen)
    with torch.no_grad():
        drafter.draft(target, prefix, lens, bonus, lens, cache, impl="ref")  # fills the context rows
    ctx = torch.randn(batch, drafter.block_size, width, device=dev, dtype=target.dtype, generator=gen)
    ctx_lens = torch.full((batch,), ROUND_ROWS, device=dev)
    start = lens + ctx_lens
    seqlens = getattr(cache, "seqlens", None)
    saved = None if seqlens is None else seqlens.clone()

    def reset():
        if saved is not None:
            cache.seqlens.copy_(saved)

    @torch.no_grad()
    def draft():
        return drafter.draft(target, ctx, ctx_lens, bonus, start, cache, impl=impl)

    return reset, draft


def draft_cost(drafter, target, batch: int, context: int, impl: str | None) -> dict:
    """One draft's kernels (the reset of the cache length left out) and GPU time (the reset's one copy
    kernel included: a drafting round cannot be replayed without it)."""
    reset, draft = draft_call(drafter, target, batch, context, impl)

    def round_():
        reset()
        return draft()

    round_()
    reset()
    kernels = count_kernels(draft)
    return {"batch": batch, "stage": "draft", "kernels": kernels, "us": time_graph(round_).median_us}


def cost_rows(
    target, drafter, batch: int, tokens: Sequence[int], prefix: int, impl: str | None, copy_bw: float
) -> list[dict]:
    """At one batch size: the decode step, a verify per entry of `tokens` (N, distinct, > 1) and the
    draft (its "over_decode": draft time / decode step time)."""
    capture = getattr(drafter, "target_layer_ids", ())
    rows = [forward_cost(target, batch, n, prefix, impl, copy_bw, capture) for n in [1, *sorted(set(tokens))]]
    decode_us = rows[0]["us"]
    for r in rows:
        r["over_decode"] = r["us"] / decode_us
    draft = draft_cost(drafter, target, batch, prefix, impl)
    draft["over_decode"] = draft["us"] / decode_us
    return rows + [draft]


def markdown(rows: list[dict], drafter_label: str) -> str:
    """The forward cost table under a line that states what it measures."""
    copy = next((f"{r['copy_GBps']:.0f} GB/s" for r in rows if "copy_GBps" in r), "not measured")
    intro = (
        "Per forward (CUDA graph replays, bench/timing.py; kernels: one eager forward, torch.profiler): "
        "time against the memory roofline (weights read, the routed experts it touched, cache, "
        f"activations; over the copy bandwidth measured in this run, {copy} read + written); "
        f"draft: {drafter_label}, against the decode step:"
    )
    heads = ["batch", "stage", "N tokens", "kernels", "us", "roofline us", "time / roofline",
             "experts / MoE layer", "/ decode step"]  # fmt: skip
    body = [
        [r["batch"], r["stage"], r.get("tokens", "-"), r["kernels"], f"{r['us']:.1f}",
         f"{r['roofline_us']:.1f}" if "roofline_us" in r else "-",
         f"{r['over_roofline']:.2f}x" if "over_roofline" in r else "-",
         f"{r['experts_per_layer']:.2f}" if "experts_per_layer" in r else "-", f"{r['over_decode']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    return intro + "\n\n" + markdown_table(heads, body)
