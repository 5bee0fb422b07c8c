"""Generation loops: autoregressive, DFlash (one chain of L drafted tokens) and DDTree (a best-first tree
of `budget` nodes), batch >= 1 with ragged prompts and ragged acceptance.

Per round, request b has `start[b]` tokens in the target cache and a `bonus[b]` token (committed, not yet
cached) at position start[b]. The drafter reads the target features of the rows committed since its last
call, drafts L positions, the tree (root = bonus) is verified in ONE target forward, the accepted nodes'
KV rows are compacted to start[b]..start[b]+n-1 and the rest dropped, and the target's token at the last
accepted node becomes the next bonus. DFlash is the same loop with a chain tree, so greedy DDTree,
greedy DFlash and greedy autoregressive decoding all commit the target's argmax at every position.

A round is a fixed sequence of stages (draft, tree_build, compile, verify, accept; engine/stages.py) over
device tensors allocated once (`State`): no stage reads a tensor on the host, and the batch keeps its rows
until every request is done (a finished row keeps running but commits nothing). So every stage can be
captured in a CUDA graph after the first round and replayed (`_Graphs`); the host reads the round's
committed tokens with one device-to-host copy per round. Eager rounds run the same code, so they give
the same tokens.

Since a round needs nothing from the host, on CUDA the host enqueues round k + 1 before it waits for
round k (`_Rounds`, two pinned copy slots): the device runs rounds back to back while the host copies,
commits and streams the previous one, and the host's launch and Python costs leave the critical path.
A request the host finds done is still run by the round already in flight (the host drops what that
round commits to it; the device learns of it in stream order). Near the end the host stops enqueuing
ahead: once the round in flight may end every running request (each within the most tokens that round
commits: the drafter's block for a tree or chain, one for a step), it reads that round before it
enqueues another, since a round enqueued past the end would be a whole round of device time
discarded, where waiting costs the host's read and launch. It still picks the next round's bucket
before that read (the auto budget's choice is host work of its own), on the figures a pipelined pick
has: the round in flight not read yet. A round enqueued ahead is still discarded
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

import numpy as np
import torch

from kdtree_engine.engine import checks
from kdtree_engine.engine import stages as round_stages  # its use_graphs by attribute: tests stand it in
from kdtree_engine.engine.budget import REFRESH_ROUNDS, STEP_ROUNDS, BudgetPolicy
from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.memory import call_sizes
from kdtree_engine.engine.prefill import PrefillGraphs, prefill_forward, prefill_width
from kdtree_engine.engine.requests import OnTokens, Requests
from kdtree_engine.engine.stages import Run, Stage, Stages, State, chain_tree, pick_token
from kdtree_engine.engine.stats import GenerationStats, StageTimer
from kdtree_engine.engine.text import StopStringMatcher
from kdtree_engine.impl import resolve_impl
from kdtree_engine.model.greedy import pad_prompts

__all__ = ["METHODS", "GenerationConfig", "GenerationOutput", "Runner", "chain_tree", "generate"]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per request, prompt excluded, cut after the first stop token
    stats: GenerationStats


def _reset_cache(cache) -> None:
    """Empties a cache kept from an earlier call in place (its rows past the lengths are never read)."""
    seqlens = getattr(cache, "seqlens", None)
    if isinstance(seqlens, torch.Tensor):
        seqlens.zero_()


def _prefill(run: Run, prompts: list[list[int]], state: State | None = None,
             graphs: PrefillGraphs | None = None, width: int | None = None,
             while_running: Callable[[], None] | None = None) -> State:  # fmt: skip
    """Prefill of the ragged prompts, padded to `width` (default: the longest), capturing the drafter's
    target layers; commits each request's first token, chosen from its last real row. `state`: the
    state of an earlier call of the same shape (a Runner's), reset and written in place; None: a new
    one. `graphs` (a Runner's on CUDA): the prefill replays the graph of its width, or runs eagerly and
    is captured after (in the call's capture time). `while_running`: host work done once the prefill
    is enqueued, before the host waits for its first tokens."""
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
        bonus = pick_token(run, out.logits[:, 0])  # [B]
    if while_running is not None:
        while_running()
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
        state = State(cache=cache, dcache=dcache, start=lens.clone(), bonus=bonus.clone(), active=active,
                       ctx_lens=lens.clone())  # fmt: skip
    else:
        state.start.copy_(lens)
        state.bonus.copy_(bonus)
        state.active.copy_(active)
        state.ctx_lens.copy_(lens)
    state.prompt_ctx = out.hidden
    state.prompt_static = graph is not None
    return state


class _Graphs:
    """CUDA graphs of the capturable stages of a Stages (one memory pool), each captured once, keyed by
    the stage's key, after one eager run of it (which compiles the kernels and gives the drafter context
    its per-round shape); a bucket of the auto budget is captured after its first round."""

    def __init__(self) -> None:
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def missing(self, order: list[Stage]) -> bool:
        return any(st.capturable and st.key not in self.graphs for st in order)

    def capture(self, stages: Stages, order: list[Stage]) -> None:
        for st in order:
            if st.capturable and st.key not in self.graphs:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    st.fn()
                self.graphs[st.key] = graph
        stages.frozen = True

    def run(self, stage: Stage) -> None:
        graph = self.graphs.get(stage.key)
        graph.replay() if graph is not None else stage.fn()


def _check_row_invariant(run: Run, device: torch.device) -> None:
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

    def __init__(self, state: State) -> None:
        cuda = state.committed.device.type == "cuda"
        shape, self.sent = state.committed.shape, 0
        self.slots = [torch.empty(shape, dtype=torch.int64, pin_memory=cuda) for _ in range(self.SLOTS)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(self.SLOTS)]
        self.in_flight: list[int] = []  # slots sent and not read yet, oldest first

    def send(self, state: State) -> None:
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


def _logged_pick(choice) -> tuple:
    """What stats.budget_picks keeps of a round's choice (BudgetPolicy.last_pick): why, the batch's E
    per bucket, and the steady rate and per-bucket seconds the rule weighed (None where it did not)."""
    if choice is None:
        return "?", None, None, None
    batch = None if choice.batch_expected is None else choice.batch_expected.tolist()
    return choice.why, batch, choice.rate, choice.costs


def _commit(run: Run, state: State, tokens: np.ndarray, counts: np.ndarray) -> None:
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


def _pipelined(run: Run, device: torch.device) -> bool:
    """Whether the host enqueues the next round before reading the last one (module docstring): on CUDA
    with a kernel impl, whose stages read nothing on the host. On the CPU the host is the device, and
    a round enqueued ahead would only add the wasted last one."""
    return device.type == "cuda" and resolve_impl(run.impl, device) == "triton"


def _round_commits_at_most(run: Run, bucket: int) -> int:
    """The most tokens a round of `bucket` commits to a request: one for bucket 0 (an autoregressive
    step, the auto budget's included), else the bonus token after at most L accepted drafted tokens
    (L + 1, the drafter's block: DDTree, DFlash and the auto budget's trees)."""
    if bucket == 0 or run.drafter is None:
        return 1
    return int(run.drafter.block_size)


def _may_be_last(run: Run, rounds: _Rounds) -> bool:
    """True when the round in flight may finish every running request (each within the most tokens that
    round commits to it): the host then reads it before it enqueues another (module docstring)."""
    return run.reqs.could_end_within(_round_commits_at_most(run, rounds.flight[-1].bucket))


@dataclass
class _InFlight:
    """A round enqueued and not read: its bucket, its stages (their count for the timer; the order to
    capture after it), whether its time is what the bucket costs (replayed graphs, or a later eager
    round without graphs: no compiles, no prompts), and on the CPU the host's seconds of its stages."""

    bucket: int
    order: list[Stage]
    representative: bool = False
    seconds: float | None = None


class _Rounds:
    """Enqueues rounds (every stage, replayed or eager, then the copy of its committed tokens) and reads
    them back in order. Kept by a Runner across calls: its stages, graphs, copy slots and, with the
    auto budget, its policy (costs and calibration)."""

    def __init__(self, run: Run, state: State) -> None:
        self.run, self.state = run, state
        self.stages, self.graphs, self.host = Stages(run, state), None, None
        self.flight: list[_InFlight] = []
        self.last_read: float | None = None  # the host clock at the last round read
        self.steps = 0  # autoregressive steps enqueued since the last draft (auto budget)
        self.held: int | None = None  # a bucket picked ahead of its enqueue (hold)
        self.eager = not round_stages.use_graphs(run, state.start.device)  # rounds never captured
        self.enqueued: set[int] = set()  # buckets enqueued at least once (compiled)
        depth = STEP_ROUNDS * run.drafter.block_size if run.drafter is not None else 1
        auto = run.config.auto_budget
        self.policy = (
            BudgetPolicy(self.stages.buckets, depth, refresh_rounds=REFRESH_ROUNDS, defer_refresh=True)
            if auto
            else None
        )
        if self.policy is not None:
            self.policy.new_call(run.copies, run.timer.enabled)

    @property
    def in_flight(self) -> int:
        return len(self.flight)

    def reuse(self, run: Run, state: State) -> None:
        """Binds the rounds to the next call (the same state, reset and prefilled in place)."""
        if state is not self.state:
            raise RuntimeError("_Rounds.reuse: a call of another state")
        self.run = run
        self.last_read, self.steps, self.held = None, 0, None
        self.stages.reuse(run)
        if self.policy is not None:
            self.policy.new_call(run.copies, run.timer.enabled)

    def pick(self) -> int:
        """The next round's bucket (the one bucket of a fixed budget): the one held, if any."""
        if self.held is not None:
            bucket, self.held = self.held, None
            return bucket
        return self._pick()

    def pick_first(self, run: Run) -> None:
        """Binds the rounds to a later call (reuse) and holds its first round's bucket, picked while
        the call's prefill runs: the auto budget's first pick (its static call's test computed afresh)
        is host work that would otherwise sit between the prefill and the first round. It sees the
        requests as the prefill leaves them: each with the prefill's token committed and a request of
        one token done."""
        self.reuse(run, self.state)
        if self.policy is None:
            return
        reqs = run.reqs
        remaining = reqs.limits - reqs.lengths - 1  # after the prefill's token
        self.held = self.policy.pick(reqs.active & (remaining > 0), True, remaining)

    def hold(self) -> None:
        """Picks the next round's bucket now, to be enqueued later (pick() returns it), unless one is
        held already: the policy's host work then overlaps the round in flight (_decode). A bucket held
        at a call's end is dropped (reuse); the policy forgets its choice with the call (new_call)."""
        if self.held is None:
            self.held = self._pick()

    def _pick(self) -> int:
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

    def _with_prompts(self, order: list[Stage]) -> list[Stage]:
        """A call's first round when its prompts' features are a prefill graph's output: its draft is
        that width's prompt stage (replayed once captured), and the features are taken as read."""
        s = self.state
        if s.prompt_ctx is None or not s.prompt_static or order[0].name != "draft":
            return order
        stage = self.stages.prompt_stage(s.prompt_ctx)
        s.prompt_ctx = None
        return [stage, *order[1:]]

    def refresh_policy(self) -> None:
        """The auto budget's refresh that its last observe left due (BudgetPolicy.refresh_when_due),
        done before the read of the oldest round in flight: pipelined, after the next round's enqueue,
        so that the host's refresh overlaps the device's rounds instead of delaying an enqueue."""
        if self.policy is not None:
            self.policy.refresh_when_due(self.run.reqs.active)

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
            self.run.stats.budget_picks.append(_logged_pick(self.policy.last_pick))
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

    def uncaptured(self, order: list[Stage]) -> bool:
        """Whether a capturable stage of `order` has no graph yet."""
        return self.graphs is None or self.graphs.missing(order)

    def capture(self, order: list[Stage]) -> None:
        """Captures the stages of a round's `order` not captured yet (after their first, eager, round)."""
        if self.graphs is None:
            self.graphs = _Graphs()
        self.graphs.capture(self.stages, order)
        self.last_read = None  # the next read's interval holds the capture

    def every_order(self) -> list[list[Stage]]:
        """Every order of stages a round may run: each bucket's, each bucket's after autoregressive
        steps (auto budget), and plain decoding's step of a call given to steps."""
        st = self.stages
        orders = [*st.orders.values(), *st.after_steps.values()]
        return orders + [st.plain_step] if st.plain_step else orders

    def the_rest(self, prompt_ctxs: Sequence[torch.Tensor] = ()) -> list[list[Stage]]:
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

    def run_and_capture(self, order: list[Stage]) -> None:
        """Runs `order` once, eagerly (compiling its kernels), and captures it, every request done: the
        round commits nothing, a finished row keeps its cache length and context (as rounds enqueued
        past a call's end do), and the drafter's pending context rows are held back meanwhile."""
        pending = self.state.ctx_lens.clone()
        self.state.ctx_lens.zero_()  # the drafter's cache gains no rows
        for st in order:
            st.fn()
        self.capture(order)
        self.state.ctx_lens.copy_(pending)

    def discard(self) -> list[list[Stage]]:
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


def _decode(run: Run, state: State, device: torch.device, rounds: _Rounds | None = None) -> _Rounds:
    """The decoding rounds; returns them (with their graphs) for a later call of the same shape. Once
    the stages are captured (or will never be), the host enqueues round k + 1 before it reads round k,
    so the device runs rounds back to back while the host copies, commits and streams the last one,
    except where the round in flight may end every request (then it is read first: nothing is enqueued
    past the end but after a stop). `rounds`: those of an earlier call on this state."""
    if rounds is None:
        rounds = _Rounds(run, state)
    elif rounds.run is not run:  # not bound to this call yet (pick_first binds it)
        rounds.reuse(run, state)
    speculative = run.config.method != "autoregressive"
    graphs_wanted, ahead = round_stages.use_graphs(run, device), _pipelined(run, device)
    run.stats.cuda_graphs = rounds.graphs is not None
    while run.reqs.running():
        if rounds.in_flight == 0:
            if ahead:  # a round read first (or a call's first): its read interval holds the host's work,
                rounds.last_read = None  # not what the round costs when pipelined (auto's cost table)
            rounds.enqueue(rounds.pick())
        if ahead and (rounds.graphs is not None or not graphs_wanted):
            if not _may_be_last(run, rounds):
                rounds.enqueue(rounds.pick())
            else:  # the next bucket picked while the device runs the round in flight, enqueued after
                rounds.hold()  # its read if that round was not the last
        bucket, orders = rounds.flight[0].bucket, [rounds.flight[0].order]
        rounds.refresh_policy()  # while the device runs the rounds just enqueued
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


def _capture_the_rest(run: Run, rounds: _Rounds, prefills: PrefillGraphs | None) -> None:
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
        self._state: State | None = None
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

    def _prefill(self, run: Run, prompts: list[list[int]], last: bool) -> State:
        """The call's prefill on this Runner's state: with CUDA graphs and a later call to come, padded
        to its width (engine.prefill) and replayed from that width's graph (captured after its first
        prefill); otherwise eager, padded to the longest prompt. With rounds enqueued ahead (on CUDA),
        a later call's first bucket is picked while the prefill runs (_Rounds.pick_first)."""
        first = None
        if self._rounds is not None and _pipelined(run, self.device):
            first = functools.partial(self._rounds.pick_first, run)
        if last or not round_stages.use_graphs(run, self.device):
            return _prefill(run, prompts, self._state, while_running=first)
        if self._prefills is None:
            self._prefills = PrefillGraphs()
        width = prefill_width(max(len(p) for p in prompts), self.prompt_len)
        return _prefill(run, prompts, self._state, self._prefills, width, while_running=first)

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
        run = Run(target=self.target, drafter=self.drafter, config=self.config, budget=sizes.budget,
                   noise_seed=self.config.seed % 2**64, limit=limit, max_len=self.sizes.max_len, reqs=reqs,
                   stats=stats, timer=timer, copies=copies, rows_hint=self.sizes.rows)  # fmt: skip
        round_stages.use_graphs(run, self.device)  # a ValueError now rather than after the prefill
        _check_row_invariant(run, self.device)
        t0 = timer.now()
        with torch.inference_mode():
            self._state = self._prefill(run, prompts, last)
            timer.collect()
            self._rounds = _decode(run, self._state, self.device, self._rounds)
            if not last and round_stages.use_graphs(run, self.device):
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
