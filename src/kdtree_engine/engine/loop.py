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
from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.sampling import accept_tokens, root_tree
from kdtree_engine.engine.stats import GenerationStats, StageTimer
from kdtree_engine.model.greedy import pad_prompts
from kdtree_engine.tree import AcceptResult, DraftTree, build_tree_from_logits, compile_tree

__all__ = ["METHODS", "GenerationConfig", "GenerationOutput", "chain_tree", "generate"]

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
    config: GenerationConfig
    budget: int  # nodes verified per round besides the root (0 for autoregressive decoding)
    noise_seed: int  # config.seed mod 2^64: the key of the sampled mode's counter-based noise
    limit: int | None  # the target's context length (positions < limit)
    max_len: int  # cache rows per request
    reqs: _Requests
    stats: GenerationStats
    timer: StageTimer
    draws: int = 0  # target-token choices so far: the noise offset of the next one

    @property
    def impl(self) -> str | None:
        return self.config.impl

    @property
    def capture(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.drafter.target_layer_ids) if self.drafter is not None else ()


def _accept(run: _Run, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
    """The target's token at every node (argmax or sample, a fresh noise offset per call), then the walk."""
    sampling = run.config.sampling
    acc = accept_tokens(tree, logits, sampling, seed=run.noise_seed, offset=run.draws, impl=run.impl)
    run.draws += 1
    return acc


def _pick(run: _Run, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the target's token [B] (argmax or sample): accept on root-only trees."""
    return _accept(run, root_tree(logits.shape[0], logits.device), logits[:, None]).bonus


def _start(run: _Run, prompts: list[list[int]]) -> _Batch:
    """Prefill of the ragged prompts, padded to the longest, capturing the drafter's target layers;
    commits each request's first token, chosen from its last real row."""
    b = len(prompts)
    cache = run.target.new_cache(b, run.max_len)
    with run.timer.stage("prefill"):
        ids, lens = pad_prompts(prompts, cache.seqlens.device)
        out = run.target(
            ids, cache, lengths=lens, capture_layers=run.capture, impl=run.impl, logits_rows=lens - 1
        )
        bonus = _pick(run, out.logits[:, 0])  # [B]
    run.stats.target_forwards += 1
    for r, t in enumerate(bonus.tolist()):
        run.reqs.commit(r, [t])
    batch = _Batch(
        rows=list(range(b)),
        cache=cache,
        dcache=run.drafter.new_cache(b, run.max_len) if run.drafter is not None else None,
        start=lens,
        bonus=bonus,
        ctx=out.hidden,
        ctx_lens=lens.clone(),
    )
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
        if run.config.method == "dflash":
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
            _commit_round(run, batch, vin, out, acc)


def _commit_round(run: _Run, batch: _Batch, vin, out, acc: AcceptResult) -> None:
    """Keep the accepted rows of the target cache, hand their features to the drafter, commit the
    tokens of the accepted nodes (root excluded: it was committed last round) and the bonus token.
    vin: the round's VerifyInputs; out: the verify forward's ForwardOutput."""
    batch.cache.compact(batch.start, acc.accepted, acc.accept_len)
    idx = acc.accepted.clamp(min=0)  # [n, L + 1]
    batch.ctx = out.hidden.gather(1, idx[..., None].expand(-1, -1, out.hidden.shape[-1]))
    batch.ctx_lens, batch.start, batch.bonus = acc.accept_len, batch.start + acc.accept_len, acc.bonus
    tokens, lens = vin.input_ids.gather(1, idx).tolist(), acc.accept_len.tolist()
    for r, toks, n, bonus in zip(batch.rows, tokens, lens, acc.bonus.tolist()):
        run.stats.accept_lengths.append(n)
        run.reqs.commit(r, toks[1:n] + [bonus])
    batch.drop_finished(run.reqs)


def generate(
    target,
    drafter,
    prompts,
    config: GenerationConfig,
    *,
    on_tokens: OnTokens | None = None,
    stage_timing: bool = True,
) -> GenerationOutput:
    """Generate up to config.max_new_tokens new tokens per prompt with config.method.

    target: a kdtree_engine.model DeepseekV3ForCausalLM (or anything with its interface); drafter: a
    DFlashDrafter (or anything with `block_size`, `target_layer_ids`, `new_cache`, `draft`), may be None
    for "autoregressive"; prompts: list of token-id lists (ragged), one list, or an int tensor [B, T];
    config: a GenerationConfig. Greedy decoding (temperature 0) commits the target's argmax at every
    position with every method; sampled decoding draws each target token independently, keyed by
    config.seed and one offset per draw, so a run is reproducible. A request stops after a token in
    config.stop_tokens (kept) or at the target's context limit. on_tokens(b, tokens) streams each
    request's newly committed tokens. stage_timing=False skips the per-stage timers (and their device
    syncs); the wall time is still taken. Returns GenerationOutput(tokens [B][n_b] new tokens, stats).
    """
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"config: expected a GenerationConfig, got {type(config).__name__}")
    cfg = target.config
    limit = getattr(cfg, "max_position_embeddings", None)
    method, max_new_tokens = config.method, config.max_new_tokens
    checks.check_drafter(target, drafter, method)
    prompts = checks.check_prompts(prompts, cfg.vocab_size, limit)
    stops = checks.check_stop_tokens(config.stop_tokens, cfg.vocab_size)
    block_size = drafter.block_size if method != "autoregressive" else 1
    budget = config.tree_budget(block_size)
    limits = [max_new_tokens if limit is None else min(max_new_tokens, limit - len(p)) for p in prompts]
    # The last round of a request may write a whole tree past its limit before the request is dropped.
    margin = 2 if method == "autoregressive" else budget + block_size + 2
    max_len = max(len(p) for p in prompts) + max_new_tokens + margin
    device = target.lm_head.weight.device
    stats = GenerationStats(method=method, batch_size=len(prompts))
    timer = StageTimer(device, enabled=stage_timing)
    reqs = _Requests(limits=limits, stops=stops, on_tokens=on_tokens)
    if not any(reqs.active):
        return GenerationOutput(tokens=reqs.tokens, stats=stats)
    run = _Run(
        target=target,
        drafter=drafter,
        config=config,
        budget=budget,
        noise_seed=config.seed % 2**64,
        limit=limit,
        max_len=max_len,
        reqs=reqs,
        stats=stats,
        timer=timer,
    )
    t0 = timer.now()
    with torch.inference_mode():
        (_autoregressive if method == "autoregressive" else _speculative)(run, prompts)
    stats.wall_time = timer.now() - t0
    stats.stage_times = dict(timer.times)
    stats.new_tokens = [len(t) for t in reqs.tokens]
    return GenerationOutput(tokens=reqs.tokens, stats=stats)
