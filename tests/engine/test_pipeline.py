"""The pipelined rounds of engine.loop (on CUDA the host enqueues round k + 1 before it reads round k),
forced on the CPU: the same tokens, streams and stats as rounds read one by one, requests that the
host finds done while a round is already in flight, the cache margin that round needs, and no round
enqueued ahead while the one in flight may end every request."""

from __future__ import annotations

import pytest

from kdtree_engine.engine import GenerationConfig, SamplingParams, generate, loop
from kdtree_engine.engine import stages as round_stages
from kdtree_engine.engine.budget import BudgetPolicy
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import HostPrefillGraphs, OracleDrafter, random_prompts, tiny_drafter, tiny_target


def _run(monkeypatch, pipelined: bool, target, drafter, prompts, config, **kw):
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    streamed: dict[int, list[int]] = {b: [] for b in range(len(prompts))}
    out = generate(target, drafter, prompts, config, on_tokens=lambda b, t: streamed[b].extend(t), **kw)
    assert [streamed[b] for b in range(len(prompts))] == out.tokens
    return out


@pytest.mark.parametrize("method", ["ddtree", "dflash", "autoregressive"])
def test_pipelined_rounds_commit_what_rounds_read_one_by_one_commit(monkeypatch, method):
    """Request 0 (the longest prompt: it sets the cache rows) gets whole blocks accepted and reaches its
    limit first: the round in flight then commits another block past it on the device, and the rounds
    after that write whole trees there while request 1, accepting one token per round before position
    20, runs on (the cache margin, engine.memory.cache_rows)."""
    target = tiny_target(4)
    prompts = random_prompts(21, [20, 3], target.config.vocab_size)
    n = 27

    def rank(pos: int) -> int:
        return 0 if pos >= 20 else 9  # rank 9 is outside the drafted top 2: nothing accepted

    oracle = OracleDrafter(target, prompts, n + 40, block_size=8, rank=rank, top=2)
    drafter = None if method == "autoregressive" else oracle
    config = GenerationConfig(max_new_tokens=n, method=method, budget=8)
    one_by_one = _run(monkeypatch, False, target, drafter, prompts, config)
    pipelined = _run(monkeypatch, True, target, drafter, prompts, config)
    assert pipelined.tokens == one_by_one.tokens == greedy_generate(target, prompts, n)
    a, b = pipelined.stats, one_by_one.stats
    for field in ("rounds", "target_forwards", "drafter_forwards"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.accept_lengths == b.accept_lengths and b.discarded_rounds == 0
    # the last rounds may each end the last request: read before another is enqueued, none discarded
    assert a.discarded_rounds == 0
    if method != "autoregressive":
        assert len(set(a.accept_lengths)) > 1


def test_a_request_the_host_stops_keeps_running_one_round_without_output(monkeypatch):
    """Stop tokens end requests in different rounds; the round already in flight still runs them on
    the device (their rows commit there) and the host keeps nothing of it; a random drafter makes the
    acceptance ragged."""
    target = tiny_target(0)
    prompts = random_prompts(5, [4, 7, 2, 6], target.config.vocab_size)
    full = greedy_generate(target, prompts, 30)
    stops = (full[0][6], full[2][11])
    drafter = tiny_drafter(0, block_size=8)
    config = GenerationConfig(max_new_tokens=30, method="ddtree", budget=16, stop_tokens=stops)
    one_by_one = _run(monkeypatch, False, target, drafter, prompts, config)
    pipelined = _run(monkeypatch, True, target, drafter, prompts, config)
    assert pipelined.tokens == one_by_one.tokens
    assert any(len(t) < 30 for t in pipelined.tokens)
    assert pipelined.stats.accept_lengths == one_by_one.stats.accept_lengths


def test_sampled_pipelined_rounds_draw_the_same_tokens(monkeypatch):
    """Sampled decoding keys each draw by its offset: the rounds enqueued ahead take the same offsets."""
    target = tiny_target(1)
    prompts = random_prompts(8, [5, 3], target.config.vocab_size)
    drafter = tiny_drafter(1, block_size=6)
    config = GenerationConfig(
        max_new_tokens=20, method="ddtree", budget=8, seed=7, sampling=SamplingParams(temperature=1.0)
    )
    one_by_one = _run(monkeypatch, False, target, drafter, prompts, config)
    pipelined = _run(monkeypatch, True, target, drafter, prompts, config)
    assert pipelined.tokens == one_by_one.tokens


@pytest.mark.parametrize("method", ["ddtree", "autoregressive"])
def test_rounds_are_enqueued_ahead_until_the_one_in_flight_may_end_every_request(monkeypatch, method):
    """The host enqueues a round ahead (one already in flight) only while some running request needs
    more tokens than one round can commit (the drafter's block; 1 for autoregressive decoding): in the
    middle of the call it does, near the end it does not, and nothing is discarded."""
    target = tiny_target(2)
    prompts = random_prompts(4, [5, 9], target.config.vocab_size)
    n, block = 40, 6
    drafter = None if method == "autoregressive" else OracleDrafter(target, prompts, n + 20, block_size=block)
    most = 1 if drafter is None else block
    ahead: list[bool] = []  # per enqueue of a round with another in flight: could the call end first?
    enqueue = loop._Rounds.enqueue

    def spy(self, bucket):
        if self.in_flight:
            ahead.append(self.run.reqs.could_end_within(most))
        return enqueue(self, bucket)

    monkeypatch.setattr(loop._Rounds, "enqueue", spy)
    config = GenerationConfig(max_new_tokens=n, method=method, budget=8)
    out = _run(monkeypatch, True, target, drafter, prompts, config)
    assert out.tokens == greedy_generate(target, prompts, n)
    assert len(ahead) > 3 and not any(ahead), ahead
    assert out.stats.discarded_rounds == 0


def test_no_round_is_enqueued_after_one_that_surely_ends_every_request(monkeypatch):
    """Autoregressive decoding commits one token per round: the host knows the last round, enqueues
    nothing past it and discards nothing."""
    target = tiny_target(0)
    prompts = random_prompts(3, [4, 6], target.config.vocab_size)
    config = GenerationConfig(max_new_tokens=9, method="autoregressive")
    out = _run(monkeypatch, True, target, None, prompts, config)
    assert out.tokens == greedy_generate(target, prompts, 9) and out.stats.discarded_rounds == 0


class _HostGraphs:
    """loop._Graphs on the CPU: the same bookkeeping (a stage is captured once, after its first eager
    run), a replay that runs the stage."""

    captures = 0

    def __init__(self) -> None:
        self.graphs: dict[str, None] = {}

    def missing(self, order) -> bool:
        return any(st.capturable and st.key not in self.graphs for st in order)

    def capture(self, stages, order) -> None:
        self.graphs.update((st.key, None) for st in order if st.capturable)
        stages.frozen = True
        _HostGraphs.captures += 1

    def run(self, stage) -> None:
        stage.fn()


@pytest.mark.parametrize("budget", [8, "auto"])
def test_steady_rounds_never_sync_the_device(monkeypatch, budget):
    """With graphs on, the loop syncs the device (StageTimer.now) around a capture only: a call syncs
    at its start and end and twice per capture, and nowhere else, or the host's work of each round
    would stop overlapping the device's."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: True)
    monkeypatch.setattr(round_stages, "use_graphs", lambda run, device: True)
    monkeypatch.setattr(loop, "PrefillGraphs", HostPrefillGraphs)
    monkeypatch.setattr(loop, "_Graphs", _HostGraphs)
    syncs = []
    now = loop.StageTimer.now
    monkeypatch.setattr(loop.StageTimer, "now", lambda self: syncs.append(1) or now(self))
    target, drafter = tiny_target(2), tiny_drafter(2, block_size=6)
    prompts = random_prompts(3, [5, 8], target.config.vocab_size)
    runner = loop.Runner(target, drafter, GenerationConfig(max_new_tokens=40, budget=budget), batch_size=2,
                         prompt_len=8)  # fmt: skip
    for call in range(3):
        syncs.clear()
        _HostGraphs.captures = HostPrefillGraphs.captures = 0
        out = runner.generate(prompts, stage_timing=False)
        assert out.tokens == greedy_generate(target, prompts, 40)
        assert out.stats.rounds > 4
        captures = _HostGraphs.captures + HostPrefillGraphs.captures  # the rounds' and the prefill's
        assert len(syncs) == 2 + 2 * captures  # the call's wall clock, and each capture's
        assert call > 0 or (_HostGraphs.captures > 0 and HostPrefillGraphs.captures == 1)


def test_the_round_in_flights_bucket_sets_how_near_the_end_it_is_read_first():
    """A tree or chain in flight may commit the drafter's block (L + 1 tokens), an autoregressive step
    (bucket 0, the auto budget's too) one: a step in flight is read first only at a request's last token,
    a tree within a block of every running request's end."""
    from types import SimpleNamespace

    from kdtree_engine.engine.requests import Requests

    reqs = Requests([20, 30], frozenset(), None)
    reqs.lengths[:] = [14, 24]  # 6 tokens left each
    run = SimpleNamespace(drafter=SimpleNamespace(block_size=8), reqs=reqs)
    in_flight = lambda bucket: SimpleNamespace(flight=[SimpleNamespace(bucket=bucket)])  # noqa: E731
    assert loop._may_be_last(run, in_flight(16)) and not loop._may_be_last(run, in_flight(0))
    reqs.lengths[:] = [19, 29]
    assert loop._may_be_last(run, in_flight(0))
    reqs.lengths[:] = [19, 21]  # the second request is 9 tokens from its end: no tree ends both
    assert not loop._may_be_last(run, in_flight(16))
    reqs.active[1] = False  # unless it is done
    assert loop._may_be_last(run, in_flight(16))
    assert not loop._may_be_last(
        SimpleNamespace(drafter=None, reqs=Requests([5], frozenset(), None)), in_flight(0)
    )


def test_the_auto_budgets_picks_overlap_a_round_in_flight(monkeypatch):
    """Pipelined, every pick of the auto budget's policy after a call's first is made while a round is
    in flight, those of the last rounds too (read first, their next bucket picked before the read):
    the choice's host work stays off the path between two rounds. The picks match the rounds read, in
    order (the one held when the call ends is dropped), and the tokens stay greedy."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: True)
    monkeypatch.setattr(round_stages, "use_graphs", lambda run, device: True)
    monkeypatch.setattr(loop, "PrefillGraphs", HostPrefillGraphs)
    monkeypatch.setattr(loop, "_Graphs", _HostGraphs)
    in_flight_at_pick, picked, read = [], [], []
    pick, observe = BudgetPolicy.pick, BudgetPolicy.observe
    flights = []

    def picking(self, *args, **kwargs):
        in_flight_at_pick.append(len(flights[-1].flight) if flights else 0)
        picked.append(pick(self, *args, **kwargs))
        return picked[-1]

    def observing(self, bucket, *args, **kwargs):
        read.append(bucket)
        return observe(self, bucket, *args, **kwargs)

    init = loop._Rounds.__init__
    monkeypatch.setattr(loop._Rounds, "__init__", lambda self, *a: init(self, *a) or flights.append(self))
    monkeypatch.setattr(BudgetPolicy, "pick", picking)
    monkeypatch.setattr(BudgetPolicy, "observe", observing)
    target = tiny_target(2)
    prompts = random_prompts(3, [5, 8], target.config.vocab_size)
    drafter = OracleDrafter(target, prompts, 80, block_size=6, rank=lambda pos: 0 if pos % 3 else 9, top=2)
    runner = loop.Runner(target, drafter, GenerationConfig(max_new_tokens=40, budget="auto"), batch_size=2,
                         prompt_len=8)  # fmt: skip
    runner.generate(prompts)  # the first call captures its rounds after reading them
    for _ in range(2):
        in_flight_at_pick.clear(), picked.clear(), read.clear()
        out = runner.generate(prompts, stage_timing=False)
        assert out.tokens == greedy_generate(target, prompts, 40)
        assert sum(k > 0 for k in read) > 2  # trees: the last rounds are read first
        assert in_flight_at_pick[0] == 0 and min(in_flight_at_pick[1:]) >= 1
        assert picked[: len(read)] == read and len(picked) - len(read) <= 1 + out.stats.discarded_rounds


@pytest.mark.parametrize("budget", [8, "auto"])
def test_a_later_calls_first_bucket_is_picked_while_its_prefill_runs(monkeypatch, budget):
    """Pipelined, a Runner's later call picks its first round's bucket after the prefill is enqueued
    and before the host reads the prefill's tokens (the auto budget's first pick computes the static
    call's test afresh); the tokens stay greedy, and the first call (no rounds yet) picks after."""
    from kdtree_engine.engine.requests import Requests

    monkeypatch.setattr(loop, "_pipelined", lambda run, device: True)
    monkeypatch.setattr(round_stages, "use_graphs", lambda run, device: True)
    monkeypatch.setattr(loop, "PrefillGraphs", HostPrefillGraphs)
    monkeypatch.setattr(loop, "_Graphs", _HostGraphs)
    events, first_picks, binds = [], [], []

    def spy(owner, name: str, log: list, tag) -> None:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: log.append(tag) or real(*a, **k))

    spy(BudgetPolicy, "pick", events, "pick")
    spy(Requests, "commit_round", events, "commit")
    spy(loop._Rounds, "pick_first", binds, 1)
    target = tiny_target(2)
    prompts = random_prompts(3, [5, 8], target.config.vocab_size)
    drafter = OracleDrafter(target, prompts, 80, block_size=6, rank=lambda pos: 0 if pos % 3 else 9, top=2)
    runner = loop.Runner(target, drafter, GenerationConfig(max_new_tokens=40, budget=budget), batch_size=2,
                         prompt_len=8)  # fmt: skip
    for call in range(3):
        events.clear(), binds.clear()
        out = runner.generate(prompts, stage_timing=False)
        assert out.tokens == greedy_generate(target, prompts, 40)
        first_picks.append(events[:2])
        assert binds == ([] if call == 0 else [1])
    if budget == "auto":
        assert first_picks == [["commit", "pick"], ["pick", "commit"], ["pick", "commit"]]
