"""Generation loops: autoregressive, DFlash (one chain of L drafted tokens) and DDTree (a best-first tree
of `budget` nodes), batch >= 1 with ragged prompts and ragged acceptance.

Per round, request b has `start[b]` tokens in the target cache and a `bonus[b]` token (committed, not yet
cached) at position start[b]. The drafter reads the target features of the rows committed since its last
call, drafts L positions, the tree (root = bonus) is verified in ONE target forward, the accepted nodes'
KV rows are compacted to start[b]..start[b]+n-1 and the rest dropped, and the target's token at the last
accepted node becomes the next bonus. DFlash is the same loop with a chain tree, so greedy DDTree,
greedy DFlash and greedy autoregressive decoding all commit the target's argmax at every position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kdtree_engine.engine import checks
from kdtree_engine.engine.checks import METHODS
from kdtree_engine.engine.sampling import SamplingParams, pick_tokens
from kdtree_engine.engine.stats import GenerationStats, StageTimer
from kdtree_engine.tree import DraftTree, accept_greedy, build_tree_from_logits, compile_tree

__all__ = ["METHODS", "GenerationOutput", "chain_tree", "generate"]

OnTokens = Callable[[int, list[int]], None]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per request, prompt excluded, cut after the first stop token
    stats: GenerationStats


class _Requests:
    """Committed output per request; a request stops at its token limit or after a stop token."""

    def __init__(self, limits: list[int], stops: frozenset[int], on_tokens: OnTokens | None) -> None:
        self.tokens: list[list[int]] = [[] for _ in limits]
        self.limits, self.stops, self.on_tokens = limits, stops, on_tokens
        self.active = [n > 0 for n in limits]

    def commit(self, b: int, new: list[int]) -> None:
        room = self.limits[b] - len(self.tokens[b])
        new = new[:room]
        for i, t in enumerate(new):
            if t in self.stops:
                new = new[: i + 1]
                self.active[b] = False
                break
        self.tokens[b].extend(new)
        if len(self.tokens[b]) >= self.limits[b]:
            self.active[b] = False
        if self.on_tokens is not None and new:
            self.on_tokens(b, new)


def chain_tree(draft_logits: torch.Tensor) -> DraftTree:
    """DFlash's single chain: the argmax of each drafted position, node i+1 at depth i+1 under node i.
    draft_logits [B, L, V] -> DraftTree with budget L."""
    b, depth, _ = draft_logits.shape
    dev = draft_logits.device
    ar = torch.arange(depth + 1, device=dev)
    return DraftTree(
        tokens=draft_logits.argmax(-1),
        depths=(ar[1:]).expand(b, depth).contiguous(),
        parents=(ar - 1).expand(b, depth + 1).contiguous(),
        num_nodes=torch.full((b,), depth, dtype=torch.int64, device=dev),
        max_depth=depth,
    )


def _prefill(target, prompts: list[list[int]], cache, capture: tuple[int, ...], impl):
    """Returns (ForwardOutput, last logits [B, V]) for the ragged prompts, padded to the longest."""
    dev = cache.seqlens.device
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
    ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.int64, device=dev)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.int64, device=dev)
    out = target(ids, cache, lengths=lens, capture_layers=capture, impl=impl)
    last = out.logits[torch.arange(len(prompts), device=dev), lens - 1]  # [B, V]
    return out, last, lens


def _autoregressive(target, prompts, reqs, params, gen, stats, timer, max_len, impl) -> None:
    cache = target.new_cache(len(prompts), max_len)
    with timer.stage("prefill"):
        _, last, _ = _prefill(target, prompts, cache, (), impl)
        token = pick_tokens(last[:, None], params, gen)  # [B, 1]
    stats.target_forwards += 1
    for b, t in enumerate(token[:, 0].tolist()):
        reqs.commit(b, [t])
    while any(reqs.active):
        with timer.stage("verify"):
            logits = target(token, cache, impl=impl).logits  # [B, 1, V]
        stats.target_forwards += 1
        with timer.stage("accept"):
            token = pick_tokens(logits, params, gen)
        with timer.stage("commit"):
            for b, t in enumerate(token[:, 0].tolist()):
                if reqs.active[b]:
                    reqs.commit(b, [t])


def _speculative(
    target, drafter, prompts, reqs, params, gen, stats, timer, method, budget, limit, max_len, impl
) -> None:
    b_size, capture = len(prompts), tuple(int(i) for i in drafter.target_layer_ids)
    cache = target.new_cache(b_size, max_len)
    dcache = drafter.new_cache(b_size, max_len)
    with timer.stage("prefill"):
        out, last, start = _prefill(target, prompts, cache, capture, impl)
        bonus = pick_tokens(last[:, None], params, gen)[:, 0]  # [B]
    stats.target_forwards += 1
    for b, t in enumerate(bonus.tolist()):
        reqs.commit(b, [t])
    ctx, ctx_lens = out.hidden, start.clone()  # [B, T, F], [B]
    while any(reqs.active):
        with timer.stage("draft"):
            draft_logits = drafter.draft(target, ctx, ctx_lens, bonus, start, dcache)  # [B, L, V]
        stats.drafter_forwards += 1
        with timer.stage("tree_build"):
            if method == "dflash":
                tree = chain_tree(draft_logits)
            else:
                tree = build_tree_from_logits(draft_logits, budget, impl=impl, validate=False)
        with timer.stage("compile"):
            vin = compile_tree(tree, bonus, start, impl=impl)
            # Nodes past the context limit can never be committed; clamping keeps rope tables in range.
            positions = vin.positions.clamp(max=limit - 1) if limit is not None else vin.positions
        with timer.stage("verify"):
            out = target(
                vin.input_ids,
                cache,
                positions=positions,
                visibility=vin.visibility,
                capture_layers=capture,
                impl=impl,
            )
        stats.target_forwards += 1
        with timer.stage("accept"):
            acc = accept_greedy(tree, pick_tokens(out.logits, params, gen), impl=impl)
        with timer.stage("commit"):
            active = torch.tensor(reqs.active, device=start.device)
            keep_len = torch.where(active, acc.accept_len, 0)
            cache.compact(start, acc.accepted, keep_len)
            idx = acc.accepted.clamp(min=0)  # [B, L + 1]
            ctx = out.hidden.gather(1, idx[..., None].expand(-1, -1, out.hidden.shape[-1]))
            ctx_lens, start, bonus = keep_len, start + keep_len, acc.bonus
            _commit_round(reqs, stats, vin.input_ids.gather(1, idx), acc.accept_len, bonus)


def _commit_round(reqs: _Requests, stats: GenerationStats, tokens, accept_len, bonus) -> None:
    """tokens [B, L + 1] tokens of the accepted nodes (root first); the root was committed last round."""
    tokens, lens, bonus = tokens.tolist(), accept_len.tolist(), bonus.tolist()
    for b in range(len(tokens)):
        if reqs.active[b]:
            stats.accept_lengths.append(lens[b])
            reqs.commit(b, tokens[b][1 : lens[b]] + [bonus[b]])


def generate(
    target,
    drafter,
    prompts,
    max_new_tokens: int,
    method: str = "ddtree",
    *,
    budget: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_tokens=(),
    impl: str | None = None,
    on_tokens: OnTokens | None = None,
) -> GenerationOutput:
    """Generate up to max_new_tokens per prompt.

    target: a kdtree_engine.model DeepseekV3ForCausalLM (or anything with its interface); drafter: a
    DFlashDrafter (or anything with `block_size`, `target_layer_ids`, `new_cache`, `draft`), unused for
    "autoregressive"; prompts: list of token-id lists (ragged) or an int tensor [B, T]; method:
    "autoregressive" | "dflash" | "ddtree"; budget: DDTree nodes (root not counted), default L =
    block_size - 1. temperature 0 is greedy; otherwise the target token at every node is drawn
    independently (tempered, top-k, top-p) with a torch.Generator seeded by `seed`. A request stops after
    a token in stop_tokens (kept) or at the target's context limit. on_tokens(b, tokens) streams commits.
    Returns GenerationOutput(tokens [B][n_b] new tokens, stats).
    """
    cfg = target.config
    limit = getattr(cfg, "max_position_embeddings", None)
    checks.check_method(method, drafter, budget)
    max_new_tokens = checks.check_count(max_new_tokens, "max_new_tokens")
    prompts = checks.check_prompts(prompts, cfg.vocab_size, limit)
    stops = checks.check_stop_tokens(stop_tokens, cfg.vocab_size)
    params = SamplingParams(float(temperature), float(top_p), int(top_k))
    if method != "autoregressive":
        checks.check_drafter(target, drafter)
        depth = drafter.block_size - 1
        budget = depth if budget is None else budget
        if method == "dflash":
            budget = depth
    limits = [max_new_tokens if limit is None else min(max_new_tokens, limit - len(p)) for p in prompts]
    # A request may overshoot its limit by one round (<= L + 1 rows) before it is stopped, and a stopped
    # request's rows are still written (then dropped) by the verify forwards of the others.
    margin = 2 if method == "autoregressive" else budget + drafter.block_size + 2
    max_len = max(len(p) for p in prompts) + max_new_tokens + margin
    device = target.lm_head.weight.device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    stats = GenerationStats(method=method, batch_size=len(prompts))
    timer = StageTimer(device)
    reqs = _Requests(limits, stops, on_tokens)
    if not any(reqs.active):
        return GenerationOutput(tokens=reqs.tokens, stats=stats)
    t0 = timer.now()
    with torch.inference_mode():
        if method == "autoregressive":
            _autoregressive(target, prompts, reqs, params, gen, stats, timer, max_len, impl)
        else:
            _speculative(
                target,
                drafter,
                prompts,
                reqs,
                params,
                gen,
                stats,
                timer,
                method,
                budget,
                limit,
                max_len,
                impl,
            )
    stats.wall_time = timer.now() - t0
    stats.stage_times = dict(timer.times)
    stats.new_tokens = [len(t) for t in reqs.tokens]
    return GenerationOutput(tokens=reqs.tokens, stats=stats)
