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
from kdtree_engine.engine.sampling import SamplingParams, accept_tokens, root_tree
from kdtree_engine.engine.stats import GenerationStats, StageTimer
from kdtree_engine.model.generate import pad_prompts
from kdtree_engine.tree import AcceptResult, DraftTree, build_tree_from_logits, compile_tree
from kdtree_engine.tree.validate import check_int

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
    """Prefill of the ragged prompts, padded to the longest: (ForwardOutput, logits of each last real
    token [B, V], lengths [B] int64)."""
    ids, lens = pad_prompts(prompts, cache.seqlens.device)
    out = target(ids, cache, lengths=lens, capture_layers=capture, impl=impl, logits_rows=lens - 1)
    last = out.logits[:, 0]  # [B, V]
    return out, last, lens


@dataclass
class _Batch:
    """The requests still running, one batch row each (finished requests are dropped from the batch).

    rows [n] request index of each row; cache: the target's LatentKVCache; dcache: the drafter's cache
    (None for autoregressive); start [n] cached rows = position of the bonus token; bonus [n] the last
    committed token, not yet cached; ctx [n, C, F] / ctx_lens [n]: target features the drafter has
    not seen yet (None for autoregressive)."""

    rows: list[int]
    cache: object
    dcache: object | None
    start: torch.Tensor
    bonus: torch.Tensor
    ctx: torch.Tensor | None = None
    ctx_lens: torch.Tensor | None = None

    def drop_finished(self, reqs: _Requests) -> None:
        alive = [i for i, r in enumerate(self.rows) if reqs.active[r]]
        if not alive or len(alive) == len(self.rows):
            return
        idx = torch.tensor(alive, device=self.start.device)
        self.rows = [self.rows[i] for i in alive]
        self.cache = type(self.cache)(self.cache.kv.index_select(1, idx), self.cache.seqlens[idx])
        if self.dcache is not None:
            self.dcache = self.dcache.select(idx)
        self.start, self.bonus = self.start[idx], self.bonus[idx]
        if self.ctx is not None:
            self.ctx, self.ctx_lens = self.ctx[idx], self.ctx_lens[idx]


@dataclass
class _Run:
    """Everything one generate() call shares across rounds."""

    target: object
    drafter: object | None
    reqs: _Requests
    params: SamplingParams
    seed: int  # of the sampled mode's counter-based noise, in [0, 2^64)
    stats: GenerationStats
    timer: StageTimer
    method: str
    budget: int
    limit: int | None  # the target's context length (positions < limit)
    max_len: int  # cache rows per request
    impl: str | None
    draws: int = 0  # target-token choices so far: the noise offset of the next one

    @property
    def capture(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.drafter.target_layer_ids) if self.drafter is not None else ()


def _accept(run: _Run, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
    """The target's token at every node (argmax or sample, a fresh noise offset per call), then the walk."""
    acc = accept_tokens(tree, logits, run.params, seed=run.seed, offset=run.draws, impl=run.impl)
    run.draws += 1
    return acc


def _pick(run: _Run, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the target's token [B] (argmax or sample): accept on root-only trees."""
    return _accept(run, root_tree(logits.shape[0], logits.device), logits[:, None]).bonus


def _start(run: _Run, prompts: list[list[int]]) -> _Batch:
    """Prefill; commits each request's first token."""
    b = len(prompts)
    cache = run.target.new_cache(b, run.max_len)
    with run.timer.stage("prefill"):
        out, last, lens = _prefill(run.target, prompts, cache, run.capture, run.impl)
        bonus = _pick(run, last)  # [B]
    run.stats.target_forwards += 1
    for r, t in enumerate(bonus.tolist()):
        run.reqs.commit(r, [t])
    dcache = run.drafter.new_cache(b, run.max_len) if run.drafter is not None else None
    batch = _Batch(list(range(b)), cache, dcache, lens, bonus, out.hidden, lens.clone())
    batch.drop_finished(run.reqs)
    return batch


def _autoregressive(run: _Run, prompts: list[list[int]]) -> None:
    batch, timer = _start(run, prompts), run.timer
    while any(run.reqs.active):
        with timer.stage("verify"):
            logits = run.target(batch.bonus[:, None], batch.cache, impl=run.impl).logits  # [n, 1, V]
        run.stats.target_forwards += 1
        with timer.stage("accept"):
            batch.bonus = _pick(run, logits[:, 0])
        with timer.stage("commit"):
            for r, t in zip(batch.rows, batch.bonus.tolist()):
                run.reqs.commit(r, [t])
            batch.drop_finished(run.reqs)


def _build(run: _Run, b: _Batch) -> DraftTree:
    """One drafter forward -> the DFlash chain or the DDTree of the round."""
    with run.timer.stage("draft"):
        draft_logits = run.drafter.draft(run.target, b.ctx, b.ctx_lens, b.bonus, b.start, b.dcache)
    run.stats.drafter_forwards += 1
    with run.timer.stage("tree_build"):
        if run.method == "dflash":
            return chain_tree(draft_logits)  # [n, L, V] -> L nodes
        return build_tree_from_logits(draft_logits, run.budget, impl=run.impl, validate=False)


def _speculative(run: _Run, prompts: list[list[int]]) -> None:
    batch, timer = _start(run, prompts), run.timer
    while any(run.reqs.active):
        tree = _build(run, batch)
        with timer.stage("compile"):
            vin = compile_tree(tree, batch.bonus, batch.start, impl=run.impl)
            # Nodes past the context limit can never be committed; clamping keeps rope tables in range.
            positions = vin.positions if run.limit is None else vin.positions.clamp(max=run.limit - 1)
        with timer.stage("verify"):
            out = run.target(
                vin.input_ids,
                batch.cache,
                positions=positions,
                visibility=vin.visibility,
                capture_layers=run.capture,
                impl=run.impl,
            )  # logits [n, N, V]
        run.stats.target_forwards += 1
        with timer.stage("accept"):
            acc = _accept(run, tree, out.logits)
        with timer.stage("commit"):
            _commit_round(run.reqs, run.stats, batch, vin, out, acc)


def _commit_round(reqs: _Requests, stats: GenerationStats, batch: _Batch, vin, out, acc) -> None:
    """Keep the accepted rows of the target cache, hand their features to the drafter, commit the
    tokens of the accepted nodes (root excluded: it was committed last round) and the bonus token."""
    batch.cache.compact(batch.start, acc.accepted, acc.accept_len)
    idx = acc.accepted.clamp(min=0)  # [n, L + 1]
    batch.ctx = out.hidden.gather(1, idx[..., None].expand(-1, -1, out.hidden.shape[-1]))
    batch.ctx_lens, batch.start, batch.bonus = acc.accept_len, batch.start + acc.accept_len, acc.bonus
    tokens, lens = vin.input_ids.gather(1, idx).tolist(), acc.accept_len.tolist()
    for r, toks, n, bonus in zip(batch.rows, tokens, lens, acc.bonus.tolist()):
        stats.accept_lengths.append(n)
        reqs.commit(r, toks[1:n] + [bonus])
    batch.drop_finished(reqs)


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
    stage_timing: bool = True,
) -> GenerationOutput:
    """Generate up to max_new_tokens per prompt.

    target: a kdtree_engine.model DeepseekV3ForCausalLM (or anything with its interface); drafter: a
    DFlashDrafter (or anything with `block_size`, `target_layer_ids`, `new_cache`, `draft`), unused for
    "autoregressive"; prompts: list of token-id lists (ragged) or an int tensor [B, T]; method:
    "autoregressive" | "dflash" | "ddtree"; budget: DDTree nodes (root not counted), default L =
    block_size - 1. temperature 0 is greedy; otherwise the target token at every node is drawn
    independently (tempered, top-k, top-p) by accept_sampled's counter-based noise, keyed by
    `seed` (any int, taken mod 2^64) and one offset per draw, so a run is reproducible. A request stops after
    a token in stop_tokens (kept) or at the target's context limit. on_tokens(b, tokens) streams commits.
    stage_timing=False skips the per-stage timers (and their CUDA syncs); the wall time is still taken.
    Returns GenerationOutput(tokens [B][n_b] new tokens, stats).
    """
    cfg = target.config
    limit = getattr(cfg, "max_position_embeddings", None)
    checks.check_method(method, drafter, budget)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens")
    prompts = checks.check_prompts(prompts, cfg.vocab_size, limit)
    stops = checks.check_stop_tokens(stop_tokens, cfg.vocab_size)
    params = SamplingParams(float(temperature), float(top_p), int(top_k))
    seed = check_int(seed, "seed", minimum=-(2**63)) % 2**64
    if method != "autoregressive":
        checks.check_drafter(target, drafter)
        depth = drafter.block_size - 1
        budget = depth if budget is None else budget
        if method == "dflash":
            budget = depth
    limits = [max_new_tokens if limit is None else min(max_new_tokens, limit - len(p)) for p in prompts]
    # The last round of a request may write a whole tree past its limit before the request is dropped.
    margin = 2 if method == "autoregressive" else budget + drafter.block_size + 2
    max_len = max(len(p) for p in prompts) + max_new_tokens + margin
    device = target.lm_head.weight.device
    stats = GenerationStats(method=method, batch_size=len(prompts))
    timer = StageTimer(device, enabled=stage_timing)
    reqs = _Requests(limits, stops, on_tokens)
    if not any(reqs.active):
        return GenerationOutput(tokens=reqs.tokens, stats=stats)
    run = _Run(target, drafter, reqs, params, seed, stats, timer, method, budget or 0, limit, max_len, impl)
    t0 = timer.now()
    with torch.inference_mode():
        (_autoregressive if method == "autoregressive" else _speculative)(run, prompts)
    stats.wall_time = timer.now() - t0
    stats.stage_times = dict(timer.times)
    stats.new_tokens = [len(t) for t in reqs.tokens]
    return GenerationOutput(tokens=reqs.tokens, stats=stats)
