"""The stages of a decoding round (engine/loop.py runs them): the device state of a generate() call
(`State`), what the call shares across rounds (`Run`), and per bucket the fixed sequence of stages
(draft, tree_build, compile, verify, accept; an autoregressive step's decode and accept), each reading
and writing device tensors only, so that every stage can be captured in a CUDA graph and replayed."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kdtree_engine.engine.budget import STEP_ROUNDS, auto_buckets, chain_bucket, round_report
from kdtree_engine.engine.commit import RoundState, commit_round
from kdtree_engine.engine.config import GenerationConfig
from kdtree_engine.engine.requests import Requests
from kdtree_engine.engine.sampling import accept_tokens, root_tree
from kdtree_engine.engine.stats import GenerationStats, StageTimer
from kdtree_engine.impl import resolve_impl
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
class State:
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
class Run:
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


def use_graphs(run: Run, device: torch.device) -> bool:
    """config.cuda_graphs, or by default: on CUDA with a kernel impl (the "ref" ops read values on the
    host)."""
    wanted = run.config.cuda_graphs
    possible = device.type == "cuda" and resolve_impl(run.impl, device) == "triton"
    if wanted and not possible:
        raise ValueError(
            "cuda_graphs: needs a CUDA target and a kernel impl (impl 'triton', 'hopper' or None)"
        )
    return possible if wanted is None else wanted


def step_tail(batch: int, width: int, buckets: int, device: torch.device) -> torch.Tensor:
    """The auto budget's copy of an autoregressive step past its one token ([batch, width - 1 + 2
    buckets] int64): the empty token slots, then a report of NaN (no draft), made once outside any
    capture so that a step's commit is one launch."""
    nan = torch.full((batch, 2 * buckets), float("nan"), dtype=torch.float64, device=device)
    return torch.cat(
        [torch.zeros(batch, width - 1, dtype=torch.int64, device=device), nan.view(torch.int64)], 1
    )


def accept_round(run: Run, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
    """The target's token at every node (argmax or sample, a fresh noise offset per call), then the walk."""
    sampling = run.config.sampling
    acc = accept_tokens(tree, logits, sampling, seed=run.noise_seed, offset=run.draws, impl=run.impl)
    run.draws += 1
    return acc


def pick_token(run: Run, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the target's token [B] (argmax or sample): accept on root-only trees."""
    return accept_round(run, root_tree(logits.shape[0], logits.device), logits[:, None]).bonus


class Stage(NamedTuple):
    """One stage of a round: `name` its timer's (engine.stats.STAGES), `key` its graph's (a stage of one
    bucket of the auto budget: "verify@8"), whether it can be captured."""

    name: str
    fn: Callable[[], None]
    capturable: bool
    key: str


class Stages:
    """The stages of one round of run.config.method on `state`, in order, per bucket (the budget of the
    round: one bucket for a fixed budget; engine.budget.auto_buckets with budget "auto", 0 being an
    autoregressive step that feeds the drafter's context). Each stage reads and writes device tensors
    only: the state, in place, and the outputs of the stages before it in the round (attributes of this
    object)."""

    def __init__(self, run: Run, state: State) -> None:
        self.run, self.s = run, state
        self.keys = self.draw = self.keys_seed = None
        # per bucket: its tree, its verify inputs (ids, positions, visibility), its report's codes (auto)
        self.trees: dict[int, DraftTree] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.codes: dict[int, ReportCodes] = {}
        self.topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.frozen = False  # set once graphs hold the stages' outputs: eager stages then copy into them
        self.prompt_stages: dict[int, Stage] = {}  # a call's first draft per prefill width (prompt_stage)
        device = state.start.device
        if not run.config.sampling.greedy and use_graphs(run, device):
            # Sampled draws keyed on the device, so that accept can be captured: one row per draw.
            table = stream_key_table(run.noise_seed, run.max_len + 3)  # draws <= rounds + 2 <= max_len + 3
            self.keys = table.to(device)
            self.keys_seed = run.noise_seed  # the seed the table holds (reuse)
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
            self.step_tail = step_tail(
                state.start.shape[0], run.drafter.block_size, len(self.buckets), device
            )
        self.orders: dict[int, list[Stage]] = {}
        self.after_steps: dict[int, list[Stage]] = {}  # auto budget: a bucket's round after AR steps
        self.plain_step: list[Stage] = []  # auto budget: a step of a call given to steps
        if run.config.method == "autoregressive":
            self.orders[0] = [Stage("verify", self.decode, True, "verify"),
                              Stage("accept", self.accept_one, accept, "accept")]  # fmt: skip
            return
        for n in self.buckets:
            tag = f"@{n}" if auto else ""
            if auto and n == 0:
                decode = functools.partial(self.decode, into_context=True)
                self.orders[0] = [Stage("verify", decode, True, "verify@0"),
                                  Stage("accept", self.accept_one, accept, "accept@0")]  # fmt: skip
                # a call given to steps (BudgetPolicy.stepping): plain decoding's step, no features kept,
                # its logits its own (a stage captured after the first writes a shared output by a copy)
                plain = functools.partial(self.decode, into="step_logits")
                plain_accept = functools.partial(self.accept_one, logits="step_logits")
                self.plain_step = [Stage("verify", plain, True, "verify@steps"),
                                   Stage("accept", plain_accept, accept, "accept@steps")]  # fmt: skip
                continue
            verify, accept_n = functools.partial(self.verify, n), functools.partial(self.accept, n)
            build, compile_n = functools.partial(self.tree_build, n), functools.partial(self.compile, n)
            self.orders[n] = [
                Stage("draft", self.draft, drafter, "draft"),
                Stage("tree_build", build, True, "tree_build" + tag),
                Stage("compile", compile_n, True, "compile" + tag),
                Stage("verify", verify, True, "verify" + tag),
                Stage("accept", accept_n, accept, "accept" + tag),
            ]
            if auto:  # after autoregressive steps: the draft reads the whole context buffer
                wide = Stage("draft", functools.partial(self.draft, wide=True), drafter, "draft_wide")
                self.after_steps[n] = [wide, *self.orders[n][1:]]

    def _choose(self, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        """accept_round, with the sampled draw's keys read on the device when the stages are captured."""
        if self.keys is None:
            return accept_round(self.run, tree, logits)
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

    def prompt_stage(self, ctx: torch.Tensor) -> Stage:
        """The first draft of a call whose prompts' features are a prefill graph's output `ctx` [B, T, F]
        (the same tensor in every call of width T): a stage of its own per width, captured like the
        others."""
        stage = self.prompt_stages.get(ctx.shape[1])
        if stage is None or stage.fn.args[0] is not ctx:
            fn = functools.partial(self.draft_from, ctx)
            stage = Stage("draft", fn, self.drafter_capturable, f"draft@prompts{ctx.shape[1]}")
            self.prompt_stages[ctx.shape[1]] = stage
        return stage

    def draft_from(self, ctx: torch.Tensor) -> None:
        """The drafter on the context features `ctx` (a call's first draft: the prompts')."""
        run, s = self.run, self.s
        self._put(
            "draft_logits",
            run.drafter.draft(run.target, ctx, s.ctx_lens, s.bonus, s.start, s.dcache, impl=run.impl),
        )

    def reuse(self, run: Run) -> None:
        """Binds the stages to the next call's run (a Runner's later call): its sampled draws start at
        run.draws, keyed by its seed, in the key table the captured accept reads (rebuilt only for a
        seed other than the last call's)."""
        self.run = run
        if self.keys is not None:
            if run.noise_seed != self.keys_seed:
                self.keys.copy_(stream_key_table(run.noise_seed, self.keys.shape[0]).to(self.keys.device))
                self.keys_seed = run.noise_seed
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

    def decode(self, into_context: bool = False, into: str = "logits") -> None:
        """One decode forward of the bonus tokens, its logits put in the attribute `into` (accept_one's).
        into_context (the auto budget's autoregressive step): it also captures the drafter's target
        layers and appends the token's features to the drafter's context (the next draft reads every
        row committed since the last one)."""
        run, s = self.run, self.s
        lengths = s.active.long()  # a done request rewrites its row and keeps its length
        capture = run.capture if into_context else ()
        out = run.target(s.bonus[:, None], s.cache, lengths=lengths, capture_layers=capture, impl=run.impl,
                         validate=False, row_invariant=run.config.row_invariant)  # fmt: skip
        self._put(into, out.logits)
        if into_context:
            at = s.ctx_lens.clamp(max=s.ctx.shape[1] - 1)[:, None, None].expand(-1, 1, s.ctx.shape[-1])
            s.ctx.scatter_(1, at, out.hidden)
            s.ctx_lens.add_(lengths)

    def accept_one(self, logits: str = "logits") -> None:
        """The target's token after a decode forward (its logits in the attribute `logits`), committed."""
        s = self.s
        logits = getattr(self, logits)[:, :1]
        token = self._choose(root_tree(logits.shape[0], logits.device), logits).bonus
        n = s.active.long()
        self._commit_step(n, token[:, None])
        s.bonus.copy_(torch.where(s.active, token, s.bonus))
        s.start.add_(n)
