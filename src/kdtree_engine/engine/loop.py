"""Generation loops: autoregressive, DFlash (one chain of L drafted tokens) and DDTree (a best-first tree
of `budget` nodes), batch >= 1 with ragged prompts and ragged acceptance.

Per round, request b has `start[b]` tokens in the target cache and a `bonus[b]` token (committed, not yet
cached) at position start[b]. The drafter reads the target features of the rows committed since its last
call, drafts L positions, the tree (root = bonus) is verified in ONE target forward, the accepted nodes'
KV rows are compacted to start[b]..start[b]+n-1 and the rest dropped, and the target's token at the last
accepted node becomes the next bonus. DFlash is the same loop with a chain tree, so greedy DDTree,
greedy DFlash and greedy autoregressive decoding all commit the target's argmax at every position.

A round is a fixed sequence of stages (draft, tree_build, compile, verify, accept) over device tensors
allocated once (`_State`): no stage reads a tensor on the host, and the batch keeps its rows until every
request is done (a finished row keeps running but commits nothing). So every stage can be captured in a
CUDA graph after the first round and replayed (`_Graphs`); the host reads the round's committed tokens
with one device-to-host copy per round. Eager rounds run the same code, so they give the same tokens.

Since a round needs nothing from the host, on CUDA the host enqueues round k + 1 before it waits for
round k (`_Rounds`, two pinned copy slots): the device runs rounds back to back while the host copies,
commits and streams the previous one, and the host's launch and Python costs leave the critical path.
A request the host finds done is still run by the round already in flight (the host drops what that
round commits to it; the device learns of it in stream order). Near the end the host stops enqueuing
ahead: once the round in flight may end every running request (each within the most tokens that round
commits: the drafter's block for a tree or chain, one for a step), it reads that round before it
enqueues another, since a round enqueued past the end would be a whole round of device time
discarded, where waiting costs the host's read and launch. A round enqueued ahead is still discarded
when a stop token or string ends the last requests early (`GenerationStats.discarded_rounds`).

The host hands each request its committed tokens and finishes a request at its token limit, after a
stop token, or at the token whose text completes a stop string (decoded as the tokens arrive, from
that same per-round copy); a finished request's row stays in the batch and commits nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kdtree_engine.engine import checks
from kdtree_engine.engine.budget import STEP_ROUNDS, BudgetPolicy, auto_buckets, chain_bucket, round_report
from kdtree_engine.engine.commit import RoundState, commit_round
from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.memory import call_sizes
from kdtree_engine.engine.prefill import PrefillGraphs, prefill_forward, prefill_width
from kdtree_engine.engine.requests import OnTokens, Requests
from kdtree_engine.engine.sampling import accept_tokens, root_tree
from kdtree_engine.engine.stats import GenerationStats, StageTimer
from kdtree_engine.engine.text import StopStringMatcher
from kdtree_engine.impl import resolve_impl
from kdtree_engine.model.greedy import pad_prompts
from kdtree_engine.ref.round_report import ReportCodes, report_codes
from kdtree_engine.ref.sampling import stream_key_table
from kdtree_engine.tree import (
    AcceptResult,
    DraftTree,
    build_tree,
    build_tree_from_logits,
    compile_tree,
    logits_topk,
)

__all__ = ["METHODS", "GenerationConfig", "GenerationOutput", "Runner", "chain_tree", "generate"]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per request, prompt excluded, cut after the first stop token
    stats: GenerationStats


def chain_tree(draft_logits: torch.Tensor) -> DraftTree:
    """DFlash's single chain: the argmax of each drafted position, node i+1 at depth i+1 under node i.
    draft_logits [B, L, V] -> DraftTree with budget L."""
    return chain_of(draft_logits.argmax(-1))


def chain_of(tokens: torch.Tensor) -> DraftTree:
    """The chain of `tokens` [B, L] (int64, one per drafted position): node i+1 at depth i+1 under node
    i, budget L."""
    b, depth = tokens.shape
    dev = tokens.device
    ar = torch.arange(depth + 1, device=dev)
    return DraftTree(
        tokens=tokens,
        depths=(ar[1:]).expand(b, depth).contiguous(),
        parents=(ar - 1).expand(b, depth + 1).contiguous(),
        num_nodes=torch.full((b,), depth, dtype=torch.int64, device=dev),
        max_depth=depth,
    )


@dataclass
class _State:
    """The device tensors of one generate() call, updated in place by every round (CUDA graphs replay
    on their addresses).

    cache: the target's LatentKVCache; dcache: the drafter's cache (None for autoregressive); start [B]
    cached rows = position of the bonus token; bonus [B] the last committed token, not yet cached; active
    [B] bool: the request still runs; ctx [B, L + 1, F] / ctx_lens [B]: target features of the rows the
    last round committed, which the drafter has not seen yet (None for autoregressive; written by the
    first round's accept); prompt_ctx [B, T, F]: the prompts' features, read by the first draft of a call
    instead of ctx, then None; prompt_static: prompt_ctx is a prefill graph's output (the same tensor in
    every call of its width, so that the first draft can be captured too); committed [B, 1 + W]: what
    the last round committed per request, for the host in one copy: the count n, then the n tokens
    (allocated by the first round)."""

    cache: object
    dcache: object | None
    start: torch.Tensor
    bonus: torch.Tensor
    active: torch.Tensor
    ctx: torch.Tensor | None = None
    ctx_lens: torch.Tensor | None = None
    committed: torch.Tensor | None = None
    prompt_ctx: torch.Tensor | None = None
    prompt_static: bool = False

    def put(self, name: str, value: torch.Tensor) -> None:
        """Writes value into the tensor `name` in place (a new tensor the first time or on a new shape)."""
        old = getattr(self, name)
        if old is None or old.shape != value.shape:
            setattr(self, name, value.clone())
        else:
            old.copy_(value)


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
    reqs: Requests
    stats: GenerationStats
    timer: StageTimer
    draws: int = 0  # target-token choices so far: the noise offset of the next one
    copies: list[int] | None = None  # auto budget, greedy: per request, the first with its prompt and limit
    rows_hint: int | None = None  # rows a request's own tokens fill at most (the cache's rows_hint)

    @property
    def impl(self) -> str | None:
        return self.config.impl

    @property
    def capture(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.drafter.target_layer_ids) if self.drafter is not None else ()


def _step_tail(batch: int, width: int, buckets: int, device: torch.device) -> torch.Tensor:
    """The auto budget's copy of an autoregressive step past its one token ([batch, width - 1 + 2
    buckets] int64): the empty token slots, then a report of NaN (no draft), made once outside any
    capture so that a step's commit is one launch."""
    nan = torch.full((batch, 2 * buckets), float("nan"), dtype=torch.float64, device=device)
    return torch.cat(
        [torch.zeros(batch, width - 1, dtype=torch.int64, device=device), nan.view(torch.int64)], 1
    )


def _accept(run: _Run, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
    """The target's token at every node (argmax or sample, a fresh noise offset per call), then the walk."""
    sampling = run.config.sampling
    acc = accept_tokens(tree, logits, sampling, seed=run.noise_seed, offset=run.draws, impl=run.impl)
    run.draws += 1
    return acc


def _pick(run: _Run, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the target's token [B] (argmax or sample): accept on root-only trees."""
    return _accept(run, root_tree(logits.shape[0], logits.device), logits[:, None]).bonus


def _reset_cache(cache) -> None:
    """Empties a cache kept from an earlier call in place (its rows past the lengths are never read)."""
    seqlens = getattr(cache, "seqlens", None)
    if isinstance(seqlens, torch.Tensor):
        seqlens.zero_()


def _prefill(run: _Run, prompts: list[list[int]], state: _State | None = None,
             graphs: PrefillGraphs | None = None, width: int | None = None) -> _State:  # fmt: skip
    """Prefill of the ragged prompts, padded to `width` (default: the longest), capturing the drafter's
    target layers; commits each request's first token, chosen from its last real row. `state`: the
    state of an earlier call of the same shape (a Runner's), reset and written in place; None: a new
    one. `graphs` (a Runner's on CUDA): the prefill replays the graph of its width, or runs eagerly and
    is captured after (in the call's capture time)."""
    b = len(prompts)
    cache = state.cache if state is not None else run.target.new_cache(b, run.max_len)
    cache.rows_hint = run.rows_hint  # the attention's split count: the rows in use, not the margins
    if state is not None:
        _reset_cache(cache)
        if state.dcache is not None:
            _reset_cache(state.dcache)
    with run.timer.stage("prefill"):
        ids, lens = pad_prompts(prompts, cache.seqlens.device, width)
        graph = graphs.get(ids.shape[1]) if graphs is not None else None
        if graph is not None:
            out = graph.run(ids, lens)
        else:  # with graphs, unvalidated as the capture is: the same attention plan, the same bits
            out = prefill_forward(run, cache, ids, lens, validate=graphs is None)
        bonus = _pick(run, out.logits[:, 0])  # [B]
    if graphs is not None and graph is None:
        t0 = run.timer.now()  # a device sync: only around a capture
        graphs.capture(run, cache, ids, lens)
        run.stats.cuda_graphs = True
        run.stats.capture_time += run.timer.now() - t0
    run.stats.target_forwards += 1
    run.reqs.commit_round(bonus.cpu().numpy().astype(np.int64)[:, None], np.ones(b, dtype=np.int64))
    active = torch.from_numpy(run.reqs.active.copy()).to(lens.device)
    if state is None:
        dcache = run.drafter.new_cache(b, run.max_len) if run.drafter is not None else None
        state = _State(cache=cache, dcache=dcache, start=lens.clone(), bonus=bonus.clone(), active=active,
                       ctx_lens=lens.clone())  # fmt: skip
    else:
        state.start.copy_(lens)
        state.bonus.copy_(bonus)
        state.active.copy_(active)
        state.ctx_lens.copy_(lens)
    state.prompt_ctx = out.hidden
    state.prompt_static = graph is not None
    return state


class _Stage(NamedTuple):
    """One stage of a round: `name` its timer's (engine.stats.STAGES), `key` its graph's (a stage of one
    bucket of the auto budget: "verify@8"), whether it can be captured."""

    name: str
    fn: Callable[[], None]
    capturable: bool
    key: str


class _Stages:
    """The stages of one round of run.config.method on `state`, in order, per bucket (the budget of the
    round: one bucket for a fixed budget; engine.budget.auto_buckets with budget "auto", 0 being an
    autoregressive step that feeds the drafter's context). Each stage reads and writes device tensors
    only: the state, in place, and the outputs of the stages before it in the round (attributes of this
    object)."""

    def __init__(self, run: _Run, state: _State) -> None:
        self.run, self.s = run, state
        self.keys = self.draw = None
        # per bucket: its tree, its verify inputs (ids, positions, visibility), its report's codes (auto)
        self.trees: dict[int, DraftTree] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.codes: dict[int, ReportCodes] = {}
        self.topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.frozen = False  # set once graphs hold the stages' outputs: eager stages then copy into them
        self.prompt_stages: dict[int, _Stage] = {}  # a call's first draft per prefill width (prompt_stage)
        device = state.start.device
        if not run.config.sampling.greedy and _use_graphs(run, device):
            # Sampled draws keyed on the device, so that accept can be captured: one row per draw.
            table = stream_key_table(run.noise_seed, run.max_len + 3)  # draws <= rounds + 2 <= max_len + 3
            self.keys = table.to(device)
            self.draw = torch.tensor([run.draws], device=device)
        accept = run.config.sampling.greedy or self.keys is not None  # capturable
        drafter = self.drafter_capturable = bool(getattr(run.drafter, "capturable", False))
        auto = run.config.auto_budget
        chain_nodes = run.drafter.block_size - 1 if auto else None
        self.buckets = auto_buckets(chain_nodes) if auto else (run.budget,)
        self.chain = chain_bucket(self.buckets) if auto else None  # DFlash's chain
        self.step_tail = None  # auto budget: what an autoregressive step's copy holds past its token
        if auto:
            self.codes = {n: report_codes(self.buckets, n, self.chain, device) for n in self.buckets if n}
            self.step_tail = _step_tail(
                state.start.shape[0], run.drafter.block_size, len(self.buckets), device
            )
        self.orders: dict[int, list[_Stage]] = {}
        self.after_steps: dict[int, list[_Stage]] = {}  # auto budget: a bucket's round after AR steps
        self.plain_step: list[_Stage] = []  # auto budget: a step of a call given to steps
        if run.config.method == "autoregressive":
            self.orders[0] = [_Stage("verify", self.decode, True, "verify"),
                              _Stage("accept", self.accept_one, accept, "accept")]  # fmt: skip
            return
        for n in self.buckets:
            tag = f"@{n}" if auto else ""
            if auto and n == 0:
                decode = functools.partial(self.decode, into_context=True)
                self.orders[0] = [_Stage("verify", decode, True, "verify@0"),
                                  _Stage("accept", self.accept_one, accept, "accept@0")]  # fmt: skip
                # a call given to steps (BudgetPolicy.stepping): plain decoding's step, no features kept
                self.plain_step = [_Stage("verify", self.decode, True, "verify@steps"), self.orders[0][1]]
                continue
            verify, accept_n = functools.partial(self.verify, n), functools.partial(self.accept, n)
            build, compile_n = functools.partial(self.tree_build, n), functools.partial(self.compile, n)
            self.orders[n] = [
                _Stage("draft", self.draft, drafter, "draft"),
                _Stage("tree_build", build, True, "tree_build" + tag),
                _Stage("compile", compile_n, True, "compile" + tag),
                _Stage("verify", verify, True, "verify" + tag),
                _Stage("accept", accept_n, accept, "accept" + tag),
            ]
            if auto:  # after autoregressive steps: the draft reads the whole context buffer
                wide = _Stage("draft", functools.partial(self.draft, wide=True), drafter, "draft_wide")
                self.after_steps[n] = [wide, *self.orders[n][1:]]

    def _choose(self, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        """_accept, with the sampled draw's keys read on the device when the stages are captured."""
        if self.keys is None:
            return _accept(self.run, tree, logits)
        keys = self.keys.index_select(0, self.draw.clamp(max=self.keys.shape[0] - 1)).view(2)
        config = self.run.config
        acc = accept_tokens(tree, logits, config.sampling, seed=self.run.noise_seed, offset=None,
                            impl=config.impl, stream_keys=keys)  # fmt: skip
        self.draw.add_(1)
        return acc

    def _put(self, name: str, value: torch.Tensor) -> None:
        old = getattr(self, name, None)
        if self.frozen and old is not None:
            old.copy_(value)
        else:
            setattr(self, name, value)

    def draft(self, wide: bool = False) -> None:
        """The drafter on the features it has not seen: the prompts' in a call's first round, else those
        of the rows committed since its last call. With the auto budget the context buffer holds the
        rows of one round and STEP_ROUNDS (L + 1) more: a draft after a speculative round reads its
        first L + 1 rows, one after autoregressive steps (`wide`) the whole of it."""
        run, s = self.run, self.s
        ctx = s.prompt_ctx if s.prompt_ctx is not None else s.ctx
        if s.prompt_ctx is None and run.config.auto_budget and not wide:
            ctx = ctx[:, : run.drafter.block_size]  # the rows of one round: the buffer's first L + 1
        s.prompt_ctx = None
        self.draft_from(ctx)

    def prompt_stage(self, ctx: torch.Tensor) -> _Stage:
        """The first draft of a call whose prompts' features are a prefill graph's output `ctx` [B, T, F]
        (the same tensor in every call of width T): a stage of its own per width, captured like the
        others."""
        stage = self.prompt_stages.get(ctx.shape[1])
        if stage is None or stage.fn.args[0] is not ctx:
            fn = functools.partial(self.draft_from, ctx)
            stage = _Stage("draft", fn, self.drafter_capturable, f"draft@prompts{ctx.shape[1]}")
            self.prompt_stages[ctx.shape[1]] = stage
        return stage

    def draft_from(self, ctx: torch.Tensor) -> None:
        """The drafter on the context features `ctx` (a call's first draft: the prompts')."""
        run, s = self.run, self.s
        self._put(
            "draft_logits",
            run.drafter.draft(run.target, ctx, s.ctx_lens, s.bonus, s.start, s.dcache, impl=run.impl),
        )

    def reuse(self, run: _Run) -> None:
        """Binds the stages to the next call's run (a Runner's later call): its sampled draws start at
        run.draws, keyed by its seed, in the key table the captured accept reads."""
        self.run = run
        if self.keys is not None:
            self.keys.copy_(stream_key_table(run.noise_seed, self.keys.shape[0]).to(self.keys.device))
            self.draw.fill_(run.draws)

    def tree_build(self, n: int) -> None:
        """The tree of bucket n (each bucket its own outputs: a captured graph writes them); with the
        auto budget, from a top-k kept for the nodes' log-probabilities."""
        run = self.run
        if run.config.method == "dflash":
            self.trees[n] = chain_tree(self.draft_logits)  # [B, L, V] -> L nodes
        elif n == self.chain:  # the auto budget's chain: the top-1 of each position, its log-probability
            self.topk[n] = logits_topk(self.draft_logits, 1, impl=run.impl, validate=False)
            self.trees[n] = chain_of(self.topk[n][1][..., 0])
        elif run.config.auto_budget:
            self.topk[n] = logits_topk(self.draft_logits, n, impl=run.impl, validate=False)
            self.trees[n] = build_tree(*self.topk[n], n, impl=run.impl, validate=False)
        else:
            self.trees[n] = build_tree_from_logits(self.draft_logits, n, impl=run.impl, validate=False)

    def compile(self, n: int) -> None:
        """The verify inputs of bucket n's tree."""
        run, s, tree = self.run, self.s, self.trees[n]
        vin = compile_tree(tree, s.bonus, s.start, impl=run.impl, validate=False)
        # Nodes past the context limit can never be committed; clamping keeps rope tables in range.
        pos = vin.positions if run.limit is None else vin.positions.clamp(max=run.limit - 1)
        self.inputs[n] = (vin.input_ids, pos, vin.visibility)

    def _first(self, n: int) -> tuple[DraftTree, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tree, input_ids, positions, visibility) of bucket n."""
        return self.trees[n], *self.inputs[n]

    def verify(self, n: int) -> None:
        run, s = self.run, self.s
        _, ids, positions, visibility = self._first(n)
        out = run.target(ids, s.cache, positions=positions, visibility=visibility, capture_layers=run.capture,
                         impl=run.impl, validate=False, row_invariant=run.config.row_invariant)  # fmt: skip
        setattr(self, f"out_{n}", out)  # logits [B, n + 1, V], hidden [B, n + 1, F]

    def accept(self, n: int) -> None:
        """The walk, then the commit on the device (engine.commit): the accepted rows of the target cache,
        their features for the drafter, the committed tokens (accepted nodes after the root, then the
        bonus token), the bonus token and the cache length."""
        s, out, run = self.s, getattr(self, f"out_{n}"), self.run
        tree, ids, _, _ = self._first(n)
        acc = self._choose(tree, out.logits)
        count = acc.accept_len * s.active  # tokens committed per request (0 once it is done)
        s.cache.compact(s.start, acc.accepted, count, validate=False, impl=run.impl)
        (b, w), auto = acc.accepted.shape, run.config.auto_budget
        if s.ctx is None:  # auto: room for the rows of the autoregressive steps after it
            rows = (1 + STEP_ROUNDS) * w if auto else w
            s.ctx = out.hidden.new_zeros(b, rows, out.hidden.shape[-1])
        slots = run.drafter.block_size if auto else w
        if s.committed is None:
            width = 1 + slots + (2 * len(self.buckets) if auto else 0)
            s.committed = torch.zeros(b, width, dtype=torch.int64, device=count.device)
        report = None
        if auto:  # before the commit: it reads the accepted nodes only
            report = round_report(*self.topk[n], tree, self.inputs[n][2], acc.accepted, self.codes[n],
                                  impl=run.impl)  # fmt: skip
        state = RoundState(s.ctx[:, :w], s.ctx_lens, s.committed, s.bonus, s.start)
        commit_round(count, acc.accepted, acc.bonus, ids, out.hidden, s.active, state, slots, impl=run.impl)
        if report is not None:
            s.committed[:, 1 + slots :].copy_(report.view(torch.int64))

    def _commit_step(self, count: torch.Tensor, token: torch.Tensor) -> None:
        """An autoregressive step's copy for the host: the count and the token [B, 1], with the auto
        budget then the tree rounds' other token slots and a report of NaN (no draft; the tree rounds'
        copy is written by engine.commit)."""
        tail = [self.step_tail] if self.run.config.auto_budget else []
        self.s.put("committed", torch.cat([count[:, None], token, *tail], dim=1))

    def decode(self, into_context: bool = False) -> None:
        """One decode forward of the bonus tokens. into_context (the auto budget's autoregressive step):
        it also captures the drafter's target layers and appends the token's features to the drafter's
        context (the next draft reads every row committed since the last one)."""
        run, s = self.run, self.s
        lengths = s.active.long()  # a done request rewrites its row and keeps its length
        capture = run.capture if into_context else ()
        out = run.target(s.bonus[:, None], s.cache, lengths=lengths, capture_layers=capture, impl=run.impl,
                         validate=False, row_invariant=run.config.row_invariant)  # fmt: skip
        self._put("logits", out.logits)  # one tensor for both steps: accept@0's graph reads it
        if into_context:
            at = s.ctx_lens.clamp(max=s.ctx.shape[1] - 1)[:, None, None].expand(-1, 1, s.ctx.shape[-1])
            s.ctx.scatter_(1, at, out.hidden)
            s.ctx_lens.add_(lengths)

    def accept_one(self) -> None:
        s = self.s
        logits = self.logits[:, :1]
        token = self._choose(root_tree(logits.shape[0], logits.device), logits).bonus
        n = s.active.long()
        self._commit_step(n, token[:, None])
        s.bonus.copy_(torch.where(s.active, token, s.bonus))
        s.start.add_(n)


class _Graphs:
    """CUDA graphs of the capturable stages of a _Stages (one memory pool), each captured once, keyed by
    the stage's key, after one eager run of it (which compiles the kernels and gives the drafter context
    its per-round shape); a bucket of the auto budget is captured after its first round."""

    def __init__(self) -> None:
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def missing(self, order: list[_Stage]) -> bool:
        return any(st.capturable and st.key not in self.graphs for st in order)

    def capture(self, stages: _Stages, order: list[_Stage]) -> None:
        for st in order:
            if st.capturable and st.key not in self.graphs:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    st.fn()
                self.graphs[st.key] = graph
        stages.frozen = True

    def run(self, stage: _Stage) -> None:
        graph = self.graphs.get(stage.key)
        graph.replay() if graph is not None else stage.fn()


def _use_graphs(run: _Run, device: torch.device) -> bool:
    """config.cuda_graphs, or by default: on CUDA with a kernel impl (the "ref" ops read values on the
    host)."""
    wanted = run.config.cuda_graphs
    possible = device.type == "cuda" and resolve_impl(run.impl, device) == "triton"
    if wanted and not possible:
        raise ValueError(
            "cuda_graphs: needs a CUDA target and a kernel impl (impl 'triton', 'hopper' or None)"
        )
    return possible if wanted is None else wanted


def _check_row_invariant(run: _Run, device: torch.device) -> None:
    """config.row_invariant needs the kernels: the reference ops (cuBLAS, torch's matmuls on the CPU) give
    a row other bits at other batch and tree sizes, so the promise would silently not hold."""
    if run.config.row_invariant and resolve_impl(run.impl, device) != "triton":
        raise ValueError(
            "row_invariant: needs a kernel impl ('triton', 'hopper', or None on CUDA); the reference ops "
            f"are not row-invariant (impl {run.impl!r} on {device.type})"
        )


class _HostCopy:
    """The committed counts and tokens of the rounds in flight, one device-to-host copy per round into
    its own pinned slot (two slots: the round being read and the one enqueued ahead of it), each
    followed by an event the host waits on when it reads that round."""

    SLOTS = 2

    def __init__(self, state: _State) -> None:
        cuda = state.committed.device.type == "cuda"
        shape, self.sent = state.committed.shape, 0
        self.slots = [torch.empty(shape, dtype=torch.int64, pin_memory=cuda) for _ in range(self.SLOTS)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(self.SLOTS)]
        self.in_flight: list[int] = []  # slots sent and not read yet, oldest first

    def send(self, state: _State) -> None:
        """Enqueues the copy of the round just enqueued (stream order: after its stages)."""
        slot = self.sent % self.SLOTS
        if slot in self.in_flight:
            raise RuntimeError("_HostCopy: more rounds in flight than slots")
        self.slots[slot].copy_(state.committed, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.in_flight.append(slot)
        self.sent += 1

    def forget(self) -> None:
        """Drops the rounds in flight without reading them (their copies land in stream order, before
        any later round's)."""
        self.in_flight.clear()

    def read(self, sums: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Waits for the oldest round in flight and returns its (token slots [requests, slots] int64,
        counts [requests] int64, and the last `sums` columns as float64 [requests, sums], or None):
        copies, since the slot is written again by a later round."""
        slot = self.in_flight.pop(0)
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        data = self.slots[slot].numpy()
        width = data.shape[1] - sums
        floats = data[:, width:].view(np.float64).copy() if sums else None
        return data[:, 1:width].copy(), data[:, 0].copy(), floats


def _commit(run: _Run, state: _State, tokens: np.ndarray, counts: np.ndarray) -> None:
    """Hands each running request its tokens of the round; tells the device which requests are done
    (a copy from pinned memory in stream order: the rounds enqueued after it see it; a round already in
    flight still runs the request, and the host drops what it commits)."""
    was = run.reqs.active.copy()
    kept, changed = run.reqs.commit_round(tokens, counts)
    if run.config.method != "autoregressive":
        run.stats.accept_lengths.extend(kept[was].tolist())
    if changed:
        active = torch.from_numpy(run.reqs.active.copy())
        if state.active.device.type == "cuda":
            active = active.pin_memory()
        state.active.copy_(active, non_blocking=True)


def _pipelined(run: _Run, device: torch.device) -> bool:
    """Whether the host enqueues the next round before reading the last one (module docstring): on CUDA
    with a kernel impl, whose stages read nothing on the host. On the CPU the host is the device, and
    a round enqueued ahead would only add the wasted last one."""
    return device.type == "cuda" and resolve_impl(run.impl, device) == "triton"


def _round_commits_at_most(run: _Run, bucket: int) -> int:
    """The most tokens a round of `bucket` commits to a request: one for bucket 0 (an autoregressive
    step, the auto budget's included), else the bonus token after at most L accepted drafted tokens
    (L + 1, the drafter's block: DDTree, DFlash and the auto budget's trees)."""
    if bucket == 0 or run.drafter is None:
        return 1
    return int(run.drafter.block_size)


def _may_be_last(run: _Run, rounds: _Rounds) -> bool:
    """True when the round in flight may finish every running request (each within the most tokens that
    round commits to it): the host then reads it before it enqueues another (module docstring)."""
    return run.reqs.could_end_within(_round_commits_at_most(run, rounds.flight[-1].bucket))


@dataclass
class _InFlight:
    """A round enqueued and not read: its bucket, its stages (their count for the timer; the order to
    capture after it), whether its time is what the bucket costs (replayed graphs, or a later eager
    round without graphs: no compiles, no prompts), and on the CPU the host's seconds of its stages."""

    bucket: int
    order: list[_Stage]
    representative: bool = False
    seconds: float | None = None


class _Rounds:
    """Enqueues rounds (every stage, replayed or eager, then the copy of its committed tokens) and reads
    them back in order. Kept by a Runner across calls: its stages, graphs, copy slots and, with the
    auto budget, its policy (costs and calibration)."""

    def __init__(self, run: _Run, state: _State) -> None:
        self.run, self.state = run, state
        self.stages, self.graphs, self.host = _Stages(run, state), None, None
        self.flight: list[_InFlight] = []
        self.last_read: float | None = None  # the host clock at the last round read
        self.steps = 0  # autoregressive steps enqueued since the last draft (auto budget)
        self.eager = not _use_graphs(run, state.start.device)  # rounds never captured
        self.enqueued: set[int] = set()  # buckets enqueued at least once (compiled)
        depth = STEP_ROUNDS * run.drafter.block_size if run.drafter is not None else 1
        auto = run.config.auto_budget
        self.policy = BudgetPolicy(self.stages.buckets, depth) if auto else None
        if self.policy is not None:
            self.policy.new_call(run.copies, run.timer.enabled)

    @property
    def in_flight(self) -> int:
        return len(self.flight)

    def reuse(self, run: _Run, state: _State) -> None:
        """Binds the rounds to the next call (the same state, reset and prefilled in place)."""
        if state is not self.state:
            raise RuntimeError("_Rounds.reuse: a call of another state")
        self.run = run
        self.last_read, self.steps = None, 0
        self.stages.reuse(run)
        if self.policy is not None:
            self.policy.new_call(run.copies, run.timer.enabled)

    def pick(self) -> int:
        """The next round's bucket (the one bucket of a fixed budget)."""
        if self.policy is None:
            return self.stages.buckets[0]
        reqs = self.run.reqs
        return self.policy.pick(reqs.active, self.state.prompt_ctx is not None, reqs.limits - reqs.lengths)

    def enqueue(self, bucket: int) -> None:
        order = self.stages.orders[bucket]
        if bucket == 0 and self.policy is not None and self.policy.stepping:
            order = self.stages.plain_step
            self.state.prompt_ctx = None  # no draft of this call will read the prompts' features
        if self.steps and bucket in self.stages.after_steps:
            order = self.stages.after_steps[bucket]
        self.steps = self.steps + 1 if bucket == 0 else 0
        order = self._with_prompts(order)
        prompts = self.state.prompt_ctx is not None  # the first draft reads fresh prompt features: eager
        captured = self.graphs is not None and not prompts and not self.graphs.missing(order)
        steady = captured or (self.eager and bucket in self.enqueued and not prompts)
        self.enqueued.add(bucket)
        if not (self.eager or captured or prompts):
            self.run.stats.eager_rounds += 1
        if not steady:  # its host work (eager stages, first-call compiles) lands in the read interval
            self.last_read = None
        entry = _InFlight(bucket, order, steady)
        t0 = time.perf_counter()
        for st in order:
            with self.run.timer.stage(st.name):
                replay = self.graphs is not None and not (prompts and st.key == "draft")
                self.graphs.run(st) if replay else st.fn()
        if self.state.start.device.type != "cuda" and steady:
            entry.seconds = time.perf_counter() - t0  # the CPU works synchronously
        self.host = self.host or _HostCopy(self.state)
        self.host.send(self.state)
        self.flight.append(entry)

    def _with_prompts(self, order: list[_Stage]) -> list[_Stage]:
        """A call's first round when its prompts' features are a prefill graph's output: its draft is
        that width's prompt stage (replayed once captured), and the features are taken as read."""
        s = self.state
        if s.prompt_ctx is None or not s.prompt_static or order[0].name != "draft":
            return order
        stage = self.stages.prompt_stage(s.prompt_ctx)
        s.prompt_ctx = None
        return [stage, *order[1:]]

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """The oldest round's (tokens per request, counts); the auto budget's policy learns from it."""
        entry = self.flight.pop(0)
        buckets = len(self.stages.buckets)
        tokens, counts, floats = self.host.read(2 * buckets if self.policy is not None else 0)
        seconds, self.last_read = self._cost(entry), time.perf_counter()
        self.run.stats.round_seconds.append(float("nan") if seconds is None else seconds)
        if self.policy is not None:
            rows = np.flatnonzero(self.run.reqs.active)
            j = self.stages.buckets.index(entry.bucket)
            spec = entry.bucket > 0 and floats is not None and not np.isnan(floats[0, j])
            sums, would = (floats[:, :buckets], floats[:, buckets:]) if spec else (None, None)
            self.policy.observe(entry.bucket, seconds, rows, counts, sums, would)
            self.run.stats.budgets.append(entry.bucket)
            why, batch = self.policy.last_pick or ("?", None)
            self.run.stats.budget_picks.append((why, None if batch is None else batch.tolist()))
        return tokens, counts

    def _cost(self, entry: _InFlight) -> float | None:
        """What the round just read cost (the auto budget's cost table; stats.round_seconds for every
        budget): on CUDA the host clock since the last round
        read, which with rounds enqueued ahead is the device's round or the host's work per round,
        whichever is longer (None for a round not representative: eager; or when the interval since
        the last read holds a capture or the enqueue of an eager round, whose host work can take
        seconds); on the CPU its stages' own seconds."""
        if self.state.start.device.type != "cuda":
            return entry.seconds
        if not entry.representative or self.last_read is None:
            return None
        return time.perf_counter() - self.last_read

    def uncaptured(self, order: list[_Stage]) -> bool:
        """Whether a capturable stage of `order` has no graph yet."""
        return self.graphs is None or self.graphs.missing(order)

    def capture(self, order: list[_Stage]) -> None:
        """Captures the stages of a round's `order` not captured yet (after their first, eager, round)."""
        if self.graphs is None:
            self.graphs = _Graphs()
        self.graphs.capture(self.stages, order)
        self.last_read = None  # the next read's interval holds the capture

    def every_order(self) -> list[list[_Stage]]:
        """Every order of stages a round may run: each bucket's, each bucket's after autoregressive
        steps (auto budget), and plain decoding's step of a call given to steps."""
        st = self.stages
        orders = [*st.orders.values(), *st.after_steps.values()]
        return orders + [st.plain_step] if st.plain_step else orders

    def the_rest(self, prompt_ctxs: Sequence[torch.Tensor] = ()) -> list[list[_Stage]]:
        """After a call (every request done), the orders of stages not captured yet (run_and_capture
        each, and no later call of a Runner runs a round eagerly whichever bucket its policy picks, as
        a serving engine captures every shape at startup), with a first round's draft for each prefill
        graph's features in `prompt_ctxs`. None while no speculative round has given the drafter's
        context its per-round shape (a call given to steps from its start)."""
        if self.run.reqs.running() or self.state.prompt_ctx is not None or self.state.ctx is None:
            return []
        orders = self.every_order()
        drafting = next((o for o in orders if o[0].name == "draft"), None)
        if drafting is not None:
            orders += [[self.stages.prompt_stage(ctx), *drafting[1:]] for ctx in prompt_ctxs]
        return [order for order in orders if self.uncaptured(order)]

    def run_and_capture(self, order: list[_Stage]) -> None:
        """Runs `order` once, eagerly (compiling its kernels), and captures it, every request done: the
        round commits nothing, a finished row keeps its cache length and context (as rounds enqueued
        past a call's end do), and the drafter's pending context rows are held back meanwhile."""
        pending = self.state.ctx_lens.clone()
        self.state.ctx_lens.zero_()  # the drafter's cache gains no rows
        for st in order:
            st.fn()
        self.capture(order)
        self.state.ctx_lens.copy_(pending)

    def discard(self) -> list[list[_Stage]]:
        """Forgets the rounds still in flight (enqueued ahead, past the last request's end): their
        stage times are dropped and they are counted in stats.discarded_rounds. Returns their orders
        (to be captured like a round read: they ran)."""
        self.run.timer.drop_last(sum(len(e.order) for e in self.flight))
        self.run.stats.discarded_rounds += len(self.flight)
        if self.host is not None:
            self.host.forget()
        orders = [e.order for e in self.flight]
        self.flight.clear()
        return orders


def _decode(run: _Run, state: _State, device: torch.device, rounds: _Rounds | None = None) -> _Rounds:
    """The decoding rounds; returns them (with their graphs) for a later call of the same shape. Once
    the stages are captured (or will never be), the host enqueues round k + 1 before it reads round k,
    so the device runs rounds back to back while the host copies, commits and streams the last one,
    except where the round in flight may end every request (then it is read first: nothing is enqueued
    past the end but after a stop). `rounds`: those of an earlier call on this state."""
    if rounds is None:
        rounds = _Rounds(run, state)
    else:
        rounds.reuse(run, state)
    speculative = run.config.method != "autoregressive"
    graphs_wanted, ahead = _use_graphs(run, device), _pipelined(run, device)
    run.stats.cuda_graphs = rounds.graphs is not None
    while run.reqs.running():
        if rounds.in_flight == 0:
            if ahead:  # a round read first (or a call's first): its read interval holds the host's work,
                rounds.last_read = None  # not what the round costs when pipelined (auto's cost table)
            rounds.enqueue(rounds.pick())
        if ahead and (rounds.graphs is not None or not graphs_wanted) and not _may_be_last(run, rounds):
            rounds.enqueue(rounds.pick())
        bucket, orders = rounds.flight[0].bucket, [rounds.flight[0].order]
        tokens, counts = rounds.read()  # waits for the oldest round in flight
        run.stats.rounds += 1
        run.stats.target_forwards += 1
        run.stats.drafter_forwards += int(speculative and (rounds.policy is None or bucket > 0))
        with run.timer.host_stage("commit"):
            _commit(run, state, tokens, counts)
        if not run.reqs.running():
            orders += rounds.discard()
        run.timer.collect(wait=False)
        # captured even after the call's last round, and those enqueued past it: a round first run
        # at a call's end (the auto budget's steps there) would otherwise run eagerly in every later call
        for order in orders:
            if graphs_wanted and rounds.uncaptured(order):
                t0 = run.timer.now()  # a device sync: only before a capture, never in a steady round
                rounds.capture(order)
                run.stats.cuda_graphs = True
                run.stats.capture_time += run.timer.now() - t0
    run.timer.collect()
    return rounds


def _capture_the_rest(run: _Run, rounds: _Rounds, prefills: PrefillGraphs | None) -> None:
    """After a Runner's call, each order of stages its rounds did not capture (_Rounds.the_rest, with
    the first draft of each prefill graph's width), run and captured; timed as a capture, in the call's
    capture time."""
    ctxs = [g.out.hidden for g in prefills.graphs.values() if g.out.hidden is not None] if prefills else []
    for order in rounds.the_rest(ctxs):
        t0 = run.timer.now()  # a device sync: only around a capture
        rounds.run_and_capture(order)
        run.stats.cuda_graphs = True
        run.stats.capture_time += run.timer.now() - t0


def _drafter_config(drafter):
    """The drafter's DFlashConfig (for the size of its cache), or None for a stand-in without one."""
    from kdtree_engine.drafter.config import DFlashConfig

    config = getattr(drafter, "config", None)
    return config if isinstance(config, DFlashConfig) else None


def _stop_matchers(config: GenerationConfig, tokenizer, batch: int) -> list[StopStringMatcher] | None:
    """One StopStringMatcher per request when config.stop_strings is set (they need the tokenizer)."""
    if not config.stop_strings:
        return None
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(
            "tokenizer: config.stop_strings needs the tokenizer that reads the output "
            "(anything with decode(ids, skip_special_tokens=...)), e.g. engine.load_tokenizer(model_dir)"
        )
    return [StopStringMatcher(tokenizer, config.stop_strings) for _ in range(batch)]


class Runner:
    """Generation for repeated calls of one target, drafter and config at one batch shape, keeping the
    decoding state and the CUDA graphs of its rounds between calls, as a serving engine captures its
    graphs once at startup.

    batch_size: requests per call (every call passes exactly that many prompts); prompt_len: the
    longest prompt a call may pass (in tokens). Sizes and memory are checked here for that capacity. The
    first call runs one eager round and captures the stages (generate() does this for every call);
    later calls replay from their first round, whose draft, reading the prompts' features, runs
    eagerly. A call's tokens and stats do not depend on what ran before it (sampled draws are keyed by
    its config.seed). The graphs hold the weights' addresses: build a new Runner after moving or
    reallocating the target's or the drafter's parameters.
    """

    def __init__(
        self, target, drafter, config: GenerationConfig, *, batch_size: int, prompt_len: int
    ) -> None:
        if not isinstance(config, GenerationConfig):
            raise ValueError(f"config: expected a GenerationConfig, got {type(config).__name__}")
        checks.check_drafter(target, drafter, config.method)  # the target first (checks.check_target)
        for name, value in (("batch_size", batch_size), ("prompt_len", prompt_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.target, self.drafter, self.config = target, drafter, config
        self.batch_size, self.prompt_len = batch_size, prompt_len
        self.block_size = drafter.block_size if config.method != "autoregressive" else 1
        self.device = target.lm_head.weight.device
        self.sizes = self._sizes([prompt_len] * batch_size)
        checks.check_memory(self.device, self.sizes.needs)
        self._state: _State | None = None
        self._rounds: _Rounds | None = None
        self._prefills: PrefillGraphs | None = None  # on CUDA with graphs, after the first call

    def _sizes(self, lengths: list[int]):
        cfg, drafter = self.target.config, _drafter_config(self.drafter)
        return call_sizes(cfg, self.target.dtype, self.config, lengths, self.block_size, self.device, drafter)

    def _check_shape(self, prompts: list[list[int]]) -> None:
        if len(prompts) != self.batch_size:
            raise ValueError(
                f"prompts: this Runner takes {self.batch_size} prompts per call, got {len(prompts)}"
            )
        longest = max(len(p) for p in prompts)
        if longest > self.prompt_len:
            raise ValueError(
                f"prompts: a prompt of {longest} tokens, over this Runner's prompt_len={self.prompt_len}"
            )

    def _prefill(self, run: _Run, prompts: list[list[int]], last: bool) -> _State:
        """The call's prefill on this Runner's state: with CUDA graphs and a later call to come, padded
        to its width (engine.prefill) and replayed from that width's graph (captured after its first
        prefill); otherwise eager, padded to the longest prompt."""
        if last or not _use_graphs(run, self.device):
            return _prefill(run, prompts, self._state)
        if self._prefills is None:
            self._prefills = PrefillGraphs()
        width = prefill_width(max(len(p) for p in prompts), self.prompt_len)
        return _prefill(run, prompts, self._state, self._prefills, width)

    def generate(
        self, prompts, *, on_tokens: OnTokens | None = None, stage_timing: bool = True, tokenizer=None
    ) -> GenerationOutput:
        """One call: as the module's generate() with this Runner's target, drafter and config. With CUDA
        graphs, the call also captures what later calls may replay and it did not (the prefill of its
        width, the first draft over it, the auto budget's rounds its policy did not pick; once, counted
        in stats.capture_time), so that no later call runs a round eagerly."""
        return self._call(prompts, on_tokens, stage_timing, tokenizer, last=False)

    def _call(self, prompts, on_tokens, stage_timing: bool, tokenizer, last: bool) -> GenerationOutput:
        """Runner.generate; `last`: no call follows (generate()), so nothing is captured for later."""
        cfg = self.target.config
        limit = getattr(cfg, "max_position_embeddings", None)
        prompts = checks.check_prompts(prompts, cfg.vocab_size, limit)
        self._check_shape(prompts)
        stops = checks.check_stop_tokens(self.config.stop_tokens, cfg.vocab_size)
        matchers = _stop_matchers(self.config, tokenizer, len(prompts))
        sizes = self._sizes([len(p) for p in prompts])
        stats = GenerationStats(method=self.config.method, batch_size=len(prompts))
        timer = StageTimer(self.device, enabled=stage_timing)
        reqs = Requests(limits=sizes.limits, stops=stops, on_tokens=on_tokens, matchers=matchers)
        if not reqs.running():
            return GenerationOutput(tokens=reqs.tokens, stats=stats)
        copies = _greedy_copies(self.config, prompts, sizes.limits)
        run = _Run(target=self.target, drafter=self.drafter, config=self.config, budget=sizes.budget,
                   noise_seed=self.config.seed % 2**64, limit=limit, max_len=self.sizes.max_len, reqs=reqs,
                   stats=stats, timer=timer, copies=copies, rows_hint=self.sizes.rows)  # fmt: skip
        _use_graphs(run, self.device)  # a ValueError now rather than after the prefill
        _check_row_invariant(run, self.device)
        t0 = timer.now()
        with torch.inference_mode():
            self._state = self._prefill(run, prompts, last)
            timer.collect()
            self._rounds = _decode(run, self._state, self.device, self._rounds)
            if not last and _use_graphs(run, self.device):
                _capture_the_rest(run, self._rounds, self._prefills)
        if self._rounds.policy is not None:
            stats.budget_report = self._rounds.policy.report()
        stats.wall_time = timer.now() - t0
        stats.stage_times = dict(timer.times)
        stats.new_tokens = reqs.lengths.tolist()
        return GenerationOutput(tokens=reqs.tokens, stats=stats)


def _greedy_copies(config: GenerationConfig, prompts: list[list[int]], limits: list[int]) -> list[int] | None:
    """For the auto budget's static call test (engine.budget): under greedy decoding, per request the
    index of the first request with the same prompt and token limit (the two commit the same tokens every
    round); None otherwise (sampled requests draw independently; fixed budgets do not ask)."""
    if not config.auto_budget or not config.sampling.greedy:
        return None
    first: dict[tuple, int] = {}
    return [first.setdefault((tuple(p), int(n)), b) for b, (p, n) in enumerate(zip(prompts, limits))]


def generate(
    target,
    drafter,
    prompts,
    config: GenerationConfig,
    *,
    on_tokens: OnTokens | None = None,
    stage_timing: bool = True,
    tokenizer=None,
) -> GenerationOutput:
    """Generate up to config.max_new_tokens new tokens per prompt with config.method.

    target: a kdtree_engine.model DeepseekV3ForCausalLM (or anything with its interface); drafter: a
    DFlashDrafter (or anything with `block_size`, `target_layer_ids`, `new_cache`, `draft`), may be None
    for "autoregressive"; prompts: list of token-id lists (ragged), one list, or an int tensor [B, T];
    config: a GenerationConfig. Greedy decoding (temperature 0) commits the target's argmax at every
    position with every method; sampled decoding draws each target token independently, keyed by
    config.seed and one offset per draw, so a run is reproducible. A request stops after a token in
    config.stop_tokens (kept), at the token whose text completes one of config.stop_strings (kept; the
    text is decoded with `tokenizer`, anything with decode(ids, skip_special_tokens=...), special tokens
    skipped), or at the target's context limit. on_tokens(b, tokens) streams each request's newly
    committed tokens. stage_timing=False skips the per-stage timers (and their device syncs); the wall
    time is still taken. Memory for the caches and the largest buffers is checked before anything is
    allocated (a ValueError naming the field to lower). Returns GenerationOutput(tokens [B][n_b] new
    tokens, stats). For repeated calls of one shape, a Runner keeps the captured rounds between them.
    """
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"config: expected a GenerationConfig, got {type(config).__name__}")
    checks.check_drafter(target, drafter, config.method)  # the target first (checks.check_target)
    cfg = target.config
    prompts = checks.check_prompts(prompts, cfg.vocab_size, getattr(cfg, "max_position_embeddings", None))
    # stop tokens and strings are checked again by Runner.generate; here they keep their errors ahead
    # of the Runner's size and memory checks, in generate()'s documented order
    checks.check_stop_tokens(config.stop_tokens, cfg.vocab_size)
    _stop_matchers(config, tokenizer, len(prompts))
    runner = Runner(target, drafter, config, batch_size=len(prompts), prompt_len=max(len(p) for p in prompts))
    return runner._call(prompts, on_tokens, stage_timing, tokenizer, last=True)
