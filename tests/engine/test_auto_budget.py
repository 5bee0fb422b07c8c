"""budget="auto" in the engine: every bucket keeps greedy output equal to autoregressive decoding, the
drafter's context stays complete across autoregressive rounds (every committed row's features are in
its cache or pending for its next draft), the drafter runs at the latest after 4 (L + 1) of them, and the
policy's report reaches the stats."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, Runner, SamplingParams, generate, loop
from kdtree_engine.engine import stages as round_stages
from kdtree_engine.engine.budget import PROBE_STEPS, BudgetPolicy, auto_buckets
from kdtree_engine.engine.budget_estimates import CostTable
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import (
    HostPrefillGraphs,
    OracleDrafter,
    pick_only_at_the_end,
    pick_sequence,
    random_prompts,
    tiny_drafter,
    tiny_target,
)


@pytest.fixture
def rule_alone(monkeypatch):
    """The policy without the static call's test (as for a batch whose finished rows are refilled),
    which would give a call of cheap steps to steps (no draft at all) before the context's limit."""
    monkeypatch.setattr(BudgetPolicy, "_steps_end_soonest", lambda self, *args: False)


def _context_complete(runner: Runner) -> bool:
    """Rows fed to the drafter + rows pending for its next draft == rows committed, per request."""
    s = runner._state
    return (s.dcache.seqlens + s.ctx_lens).tolist() == s.start.tolist()


@pytest.mark.parametrize("pipelined", [False, True])
def test_auto_tries_every_bucket_and_stays_greedy(monkeypatch, pipelined, rule_alone):
    """Every bucket tried (the chain's 7 included), greedy output kept, the drafter's context complete
    (the rule alone: a call given to steps leaves its context behind by design)."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    target, drafter = tiny_target(3), tiny_drafter(3, block_size=8)
    prompts = random_prompts(2, [6, 11, 3], target.config.vocab_size)
    config = GenerationConfig(max_new_tokens=45, budget="auto")
    runner = Runner(target, drafter, config, batch_size=3, prompt_len=11)
    out = runner.generate(prompts)
    assert out.tokens == greedy_generate(target, prompts, 45)
    assert set(out.stats.budgets) == set(auto_buckets(7))  # each tried once at least (exploration)
    assert out.stats.budgets[0] > 0  # the first round drafts: the prompts' features are pending
    assert out.stats.drafter_forwards == sum(k > 0 for k in out.stats.budgets)
    report = out.stats.budget_report
    assert sum(r["rounds"] for r in report.values()) == out.stats.rounds
    assert _context_complete(runner)


def test_cheap_autoregressive_steps_still_draft_every_step_rounds_blocks(monkeypatch, rule_alone):
    """With autoregressive rounds measured cheap and every tree dear, the policy steps autoregressively
    and drafts once every STEP_ROUNDS (L + 1) rounds (the drafter's context holds no more); an oracle
    drafter then gets whole blocks accepted, and the output stays greedy."""
    monkeypatch.setattr(CostTable, "estimate", lambda self, k: 1e-9 if k == 0 else 1.0)
    target = tiny_target(4)
    prompts = random_prompts(5, [7, 4], target.config.vocab_size)
    n, block = 40, 6
    drafter = OracleDrafter(target, prompts, n + 20, block_size=block, top=1)
    config = GenerationConfig(max_new_tokens=n, budget="auto")
    out = generate(target, drafter, prompts, config)
    assert out.tokens == greedy_generate(target, prompts, n)
    budgets = out.stats.budgets
    streaks = "".join("0" if k == 0 else "x" for k in budgets).split("x")
    assert budgets[0] > 0 and max(len(z) for z in streaks) == loop.STEP_ROUNDS * block  # L + 1 = block


def test_context_is_complete_after_autoregressive_rounds_with_a_real_drafter(monkeypatch, rule_alone):
    monkeypatch.setattr(CostTable, "estimate", lambda self, k: 1e-9 if k == 0 else 1.0)
    target, drafter = tiny_target(1), tiny_drafter(1, block_size=5)
    prompts = random_prompts(9, [4, 9], target.config.vocab_size)
    runner = Runner(
        target, drafter, GenerationConfig(max_new_tokens=23, budget="auto"), batch_size=2, prompt_len=9
    )
    out = runner.generate(prompts)
    assert out.tokens == greedy_generate(target, prompts, 23)
    assert 0 in out.stats.budgets and _context_complete(runner)


def test_sampled_auto_repeats_its_draws_given_the_same_choices(monkeypatch, rule_alone):
    """Sampled draws are keyed by the seed and the round; the choices depend on measured costs, so a
    run repeats only where its choices do: with costs fixed (here a deterministic table), it does."""
    monkeypatch.setattr(CostTable, "estimate", lambda self, k: 1.0 + k / 16)
    target, drafter = tiny_target(2), tiny_drafter(2, block_size=6)
    prompts = random_prompts(3, [5, 8], target.config.vocab_size)
    sampling = SamplingParams(temperature=1.0)
    config = GenerationConfig(max_new_tokens=18, budget="auto", seed=4, sampling=sampling)
    first, second = (generate(target, drafter, prompts, config) for _ in range(2))
    assert first.tokens == second.tokens and first.stats.budgets == second.stats.budgets
    assert len(set(first.stats.budgets)) > 1


def test_a_round_costs_the_host_clock_between_reads_on_cuda():
    """On CUDA a round's cost is the host clock since the last read (device-bound or host-bound,
    whichever is longer), only for representative rounds that follow a read; on the CPU, the seconds
    of its own stages."""
    import time
    from types import SimpleNamespace

    def rounds(device_type: str, last_read):
        start = SimpleNamespace(device=SimpleNamespace(type=device_type))
        return SimpleNamespace(state=SimpleNamespace(start=start), last_read=last_read)

    cost = loop._Rounds._cost
    steady, first = loop._InFlight(8, [], representative=True), loop._InFlight(8, [])
    before = time.perf_counter() - 0.25
    assert 0.25 <= cost(rounds("cuda", before), steady) < 10
    assert cost(rounds("cuda", before), first) is None  # an eager round that compiled, or the prompts'
    assert cost(rounds("cuda", None), steady) is None  # no read before it (a call's first, a capture)
    timed = loop._InFlight(8, [], representative=True, seconds=0.125)
    assert cost(rounds("cpu", before), timed) == 0.125 and cost(rounds("cpu", before), first) is None


@pytest.mark.parametrize("steps", [False, True])
def test_a_draft_reads_one_round_unless_autoregressive_steps_came_before(monkeypatch, rule_alone, steps):
    """The context buffer holds a round's rows and STEP_ROUNDS rounds' more; a draft right after a
    speculative round reads the first L + 1 rows only, one after autoregressive steps the whole
    buffer; output stays greedy."""
    cheap = (lambda self, k: 1e-9 if k == 0 else 1.0) if steps else (lambda self, k: 1.0 if k == 0 else 1e-9)
    monkeypatch.setattr(CostTable, "estimate", cheap)
    target, drafter = tiny_target(2), tiny_drafter(2, block_size=6)
    widths, draft = [], type(drafter).draft

    def recording(self, target, ctx, *args, **kwargs):
        widths.append(ctx.shape[1])
        return draft(self, target, ctx, *args, **kwargs)

    # on the class: tiny_drafter's instance is shared between tests, and undoing an instance patch
    # leaves the bound method behind on it, hiding later class patches (test_prefill's spy)
    monkeypatch.setattr(type(drafter), "draft", recording)
    prompts = random_prompts(4, [5, 8], target.config.vocab_size)
    out = generate(target, drafter, prompts, GenerationConfig(max_new_tokens=30, budget="auto"))
    assert out.tokens == greedy_generate(target, prompts, 30)
    assert widths[0] == 8  # the prompts
    assert set(widths[1:]) == ({(1 + loop.STEP_ROUNDS) * 6} if steps else {6})


def test_the_read_after_an_eager_enqueue_is_not_timed(monkeypatch):
    """An eager round's enqueue (its first replay-less run, compiles included) happens between two
    reads: the clock restarts at the next read, so no bucket is charged for it (a charged one would
    look seconds dear and never be picked again)."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: True)
    enqueue, seen = loop._Rounds.enqueue, []

    def recording(self, bucket):
        enqueue(self, bucket)
        seen.append((self.flight[-1].representative, self.last_read))

    monkeypatch.setattr(loop._Rounds, "enqueue", recording)
    target, drafter = tiny_target(3), tiny_drafter(3, block_size=6)
    prompts = random_prompts(6, [5, 9], target.config.vocab_size)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=24, budget="auto"), batch_size=2,
                    prompt_len=9)  # fmt: skip
    runner.generate(prompts)
    runner.generate(prompts)
    eager = [last for steady, last in seen if not steady]
    assert eager and all(last is None for last in eager)
    assert any(steady and last is not None for steady, last in seen)  # the later rounds are timed


def test_pipelined_auto_refreshes_its_estimates_while_the_next_round_is_in_flight(monkeypatch, rule_alone):
    """The engine's policy defers its refreshes (BudgetPolicy.defer_refresh): observe leaves one due,
    and the loop does it before the next read, after enqueueing the next round, so that the host's
    refresh runs beside two rounds in flight; no round is read with a refresh overdue."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: True)
    refresh_policy, observe, seen, left = loop._Rounds.refresh_policy, BudgetPolicy.observe, [], []

    def refreshing(self):
        due = self.policy._unrefreshed >= self.policy.refresh_rounds
        refresh_policy(self)
        seen.append((due, len(self.flight), self.policy._unrefreshed))

    def observing(self, *args, **kwargs):
        assert self._unrefreshed < self.refresh_rounds  # none overdue when a round is read
        observe(self, *args, **kwargs)
        left.append(self._unrefreshed)

    monkeypatch.setattr(loop._Rounds, "refresh_policy", refreshing)
    monkeypatch.setattr(BudgetPolicy, "observe", observing)
    target, drafter = tiny_target(3), tiny_drafter(3, block_size=6)
    prompts = random_prompts(6, [5, 9], target.config.vocab_size)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=40, budget="auto"), batch_size=2,
                    prompt_len=9)  # fmt: skip
    for _ in range(2):
        assert runner.generate(prompts).tokens == greedy_generate(target, prompts, 40)
    assert loop.REFRESH_ROUNDS in left  # observe left the refresh due
    refreshed = [(flight, after) for due, flight, after in seen if due]
    assert refreshed and all(after == 0 for _, after in refreshed)
    assert max(flight for flight, _ in refreshed) == 2  # beside the next round, enqueued


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_call_given_to_steps_never_drafts(monkeypatch, pipelined):
    """With every cost measured, steps cheap and trees dear, the static call's test gives the call to
    steps from its first round once every tree has been built: no draft at all (not even the first,
    which would read the prompts' features), plain decoding's step (no features kept for the drafter),
    greedy output; each later call on the Runner starts afresh and is given to steps again. A fresh
    Runner's first call builds them: its first round drafts, and after PROBE_STEPS of the test's steps
    the probe drafts the largest tree, which tells every bucket's S."""
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    monkeypatch.setattr(CostTable, "estimate", lambda self, k: 1e-9 if k == 0 else 1.0)
    target, drafter = tiny_target(5), tiny_drafter(5, block_size=6)
    calls, draft = [], type(drafter).draft  # patched on the class (the instance is shared: see above)
    counted = lambda *args, **kwargs: calls.append(1) or draft(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(type(drafter), "draft", counted)
    prompts = random_prompts(7, [5, 9], target.config.vocab_size)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=20, budget="auto"), batch_size=2,
                    prompt_len=9)  # fmt: skip
    first = runner.generate(prompts)
    assert first.tokens == greedy_generate(target, prompts, 20)
    assert first.stats.budgets[0] > 0 and first.stats.budgets[1 + PROBE_STEPS] == 64 and calls
    assert runner._rounds.policy._unbuilt() is None
    calls.clear()
    for _ in range(2):
        out = runner.generate(prompts)
        assert out.tokens == greedy_generate(target, prompts, 20)
        assert set(out.stats.budgets) == {0} and out.stats.drafter_forwards == 0 and not calls
        assert runner._rounds.policy.stepping
        assert runner._state.ctx_lens.tolist() == [5, 9]  # the prompts' rows only: no step kept features


class _RecordedGraphs:
    """A stand-in for loop._Graphs on the CPU: records each stage captured with the function it ran
    then, and replays that function (as a CUDA graph replays what it recorded, on the tensors it was
    captured with), the stage's own before its capture."""

    def __init__(self) -> None:
        self.graphs: dict[str, object] = {}

    def missing(self, order) -> bool:
        return any(st.capturable and st.key not in self.graphs for st in order)

    def capture(self, stages, order) -> None:
        for st in order:
            if st.capturable and st.key not in self.graphs:
                self.graphs[st.key] = st.fn
        stages.frozen = True

    def run(self, stage) -> None:
        self.graphs.get(stage.key, stage.fn)()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_round_first_run_at_a_calls_end_is_captured_for_the_next_call(monkeypatch, pipelined):
    """A bucket first picked for a call's last rounds (read, or enqueued ahead and discarded) is
    captured after them, so that the Runner's next identical call runs no eager round (graphs stood in
    for on the CPU: the loop's bookkeeping of what is captured, not CUDA's capture)."""
    monkeypatch.setattr(round_stages, "use_graphs", lambda run, device: True)
    monkeypatch.setattr(loop, "PrefillGraphs", HostPrefillGraphs)
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    monkeypatch.setattr(loop, "_Graphs", _RecordedGraphs)
    monkeypatch.setattr(BudgetPolicy, "pick", pick_only_at_the_end(32))  # bucket 32 for the last round
    target, drafter = tiny_target(6), tiny_drafter(6, block_size=8)
    prompts = random_prompts(8, [6, 10], target.config.vocab_size)
    runner = Runner(target, drafter, GenerationConfig(max_new_tokens=24, budget="auto"), batch_size=2,
                    prompt_len=10)  # fmt: skip
    outs = [runner.generate(prompts, stage_timing=False) for _ in range(2)]
    assert 32 not in outs[0].stats.budgets[:-1]  # read last, or enqueued ahead and discarded
    assert "verify@32" in runner._rounds.graphs.graphs  # captured: it ran
    assert outs[1].stats.eager_rounds == 0 and outs[1].stats.capture_time == 0.0
    assert outs[0].tokens == outs[1].tokens == greedy_generate(target, prompts, 24)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_runner_captures_every_round_after_its_first_call(monkeypatch, pipelined):
    """A Runner's first call, which picked bucket 4 alone, captures every other round after it (each
    bucket's, each after autoregressive steps, plain decoding's step): its second call, picking all of
    them, runs no eager round and captures nothing, and both commit plain greedy decoding's tokens
    (graphs stood in for on the CPU). generate(), one call, captures nothing for later."""
    monkeypatch.setattr(round_stages, "use_graphs", lambda run, device: True)
    monkeypatch.setattr(loop, "PrefillGraphs", HostPrefillGraphs)
    monkeypatch.setattr(loop, "_pipelined", lambda run, device: pipelined)
    monkeypatch.setattr(loop, "_Graphs", _RecordedGraphs)
    target, drafter = tiny_target(6), tiny_drafter(6, block_size=8)
    prompts = random_prompts(8, [6, 10], target.config.vocab_size)
    config = GenerationConfig(max_new_tokens=40, budget="auto")
    runner = Runner(target, drafter, config, batch_size=2, prompt_len=10)
    monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([4]))
    first = runner.generate(prompts, stage_timing=False)
    assert set(first.stats.budgets) == {4}
    keys = set(runner._rounds.graphs.graphs)
    assert {f"verify@{n}" for n in auto_buckets(7)} | {"verify@steps", "accept@steps", "draft_wide"} <= keys
    assert _context_complete(runner)
    monkeypatch.setattr(BudgetPolicy, "pick", pick_sequence([8, 0, 0, 16, 32, 0, 64, 7, 4], stepping_from=10))
    second = runner.generate(prompts, stage_timing=False)
    assert set(second.stats.budgets) == set(auto_buckets(7))  # the chain's bucket 7 included
    assert second.stats.eager_rounds == 0 and second.stats.capture_time == 0.0
    assert first.tokens == second.tokens == greedy_generate(target, prompts, 40)

    captured = []
    monkeypatch.setattr(loop, "_capture_the_rest", lambda run, rounds: captured.append(rounds))
    out = generate(target, drafter, prompts, config, stage_timing=False)
    assert out.tokens == first.tokens and captured == []

    # the two steps' forwards put their logits in tensors of their own: a stage captured after the
    # first (frozen) writes a shared output by a copy, a device copy of the logits in every step's graph
    stages, written = runner._rounds.stages, []
    monkeypatch.setattr(type(stages), "_put", lambda self, name, value: written.append(name))
    with torch.inference_mode():  # as the engine runs its stages
        stages.plain_step[0].fn()
        stages.orders[0][0].fn()
    assert written == ["step_logits", "logits"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_policy_is_told_which_greedy_requests_are_copies(monkeypatch, temperature):
    """generate() tells the auto budget's policy, per request, the first request with the same prompt
    and token limit under greedy decoding (their tokens are the same every round: the static call's
    tail counts them once); nothing under sampling, where each draws its own."""
    told = []
    real = BudgetPolicy.new_call

    def recording(self, copies=None, stage_timed=False):
        told.append(copies)
        real(self, copies, stage_timed)

    monkeypatch.setattr(BudgetPolicy, "new_call", recording)
    target, drafter = tiny_target(1), tiny_drafter(1)
    prompts = random_prompts(3, [4, 6], target.config.vocab_size)
    prompts = [prompts[0], prompts[1], list(prompts[0]), prompts[1][:-1]]
    sampling = SamplingParams(temperature=temperature)
    config = GenerationConfig(max_new_tokens=6, budget="auto", sampling=sampling)
    out = generate(target, drafter, prompts, config)
    assert told[-1] == ([0, 1, 0, 3] if temperature == 0 else None)
    if temperature == 0:
        assert out.tokens[0] == out.tokens[2]
