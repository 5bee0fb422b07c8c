"""`kdtree-engine bench e2e --target nano` and bench/experts.py on the CPU: the uniform-routing formula,
the expert touch counter against an independent routing of the same hidden states, the nano bench end
to end on a tiny target and drafter, and the small target's refusal to run without CUDA."""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.bench import e2e, e2e_nano, e2e_small, experts
from kdtree_engine.engine.budget import PICK_REASONS
from kdtree_engine.model.moe import MoE
from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(list(argv))


# --- the uniform-routing expectation -------------------------------------------------------------------


@pytest.mark.parametrize("e, k", [(16, 4), (384, 8), (8, 2)])
def test_uniform_touched_limits(e, k):
    assert experts.uniform_touched(e, k, 1) == pytest.approx(k)
    assert experts.uniform_touched(e, k, 0) == 0
    assert experts.uniform_touched(e, k, 10_000) == pytest.approx(e)
    values = [experts.uniform_touched(e, k, n) for n in range(1, 40)]
    assert all(a < b for a, b in zip(values, values[1:]))  # more tokens, more experts, always below E
    assert values[-1] < e


def test_uniform_touched_exact_small_case():
    # two experts, one per token, two tokens: both the same expert with probability 1/2 -> 1.5 expected
    assert experts.uniform_touched(2, 1, 2) == pytest.approx(1.5)


@pytest.mark.parametrize("e, k, n", [(16, 4, 5), (16, 4, 17), (32, 6, 3)])
def test_uniform_touched_against_monte_carlo(e, k, n):
    trials = 20_000
    gen = torch.Generator().manual_seed(e * 100 + n)
    picks = torch.rand(trials, n, e, generator=gen).argsort(-1)[..., :k]  # a random k-subset per token
    touched = torch.zeros(trials, e, dtype=torch.bool).scatter_(1, picks.reshape(trials, -1), True)
    counts = touched.sum(1).double()
    stderr = float(counts.std()) / trials**0.5
    assert abs(float(counts.mean()) - experts.uniform_touched(e, k, n)) < 4 * stderr + 1e-9


# --- the touch counter -----------------------------------------------------------------------------------


def _reference_ids(router, x: torch.Tensor) -> set[int]:
    """The routed experts of x [n, hidden], computed here from the router's weights (sigmoid scores,
    top-2 group scores, top groups, top-k of the biased scores in the kept groups)."""
    c = router.c
    scores = (x.double() @ router.weight.detach().double().T).sigmoid()
    biased = scores + router.e_score_correction_bias.double()
    per_group = c.n_routed_experts // c.n_group
    chosen: set[int] = set()
    for row in biased:
        groups = row.view(c.n_group, per_group)
        kept = groups.topk(2, dim=-1).values.sum(-1).topk(c.topk_group).indices.tolist()
        candidates = [g * per_group + j for g in kept for j in range(per_group)]
        order = sorted(candidates, key=lambda i: -float(row[i]))
        chosen.update(order[: c.num_experts_per_tok])
    return chosen


def _moe_inputs(model) -> tuple[list, list]:
    """Pre-hooks on the MoE modules that keep the hidden states each one routes, per forward."""
    seen: list[list[torch.Tensor]] = []
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]

    def keep(module, args):
        x = args[0]
        if module is moes[0]:
            seen.append([])
        seen[-1].append(x.reshape(-1, x.shape[-1]).detach().clone())

    return seen, [m.register_forward_pre_hook(keep) for m in moes]


def test_touch_counter_counts_the_ids_the_routers_chose():
    model = tiny_target(0, 96, 32, 4)
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    seen, handles = _moe_inputs(model)
    gen = torch.Generator().manual_seed(3)
    cache = model.new_cache(2, 16)
    ids = torch.randint(0, 96, (2, 5), generator=gen)
    try:
        with experts.ExpertTouches(model) as touches:
            model(ids, cache, lengths=torch.tensor([5, 3]), logits_rows=torch.tensor([4, 2]))
            model(ids[:, :1], cache)
            vis = torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3)
            model(ids[:, 2:], cache, visibility=vis)
        model(ids[:, :1], cache)  # outside the context: not recorded
    finally:
        for h in handles:
            h.remove()
    assert [(f.kind, f.batch, f.tokens) for f in touches.forwards] == [
        ("prefill", 2, 5),
        ("decode", 2, 1),
        ("verify", 2, 3),
    ]
    counts = []
    for forward, inputs in zip(touches.forwards, seen):
        expected = [sorted(_reference_ids(m.gate, x)) for m, x in zip(moes, inputs)]
        assert [list(t) for t in forward.experts] == expected
        assert forward.distinct == [len(t) for t in expected]
        counts += forward.distinct
    assert min(counts) < model.config.n_routed_experts  # the counts are not all trivially E
    assert len(touches.forwards[0].experts) == len(moes)


def test_touch_rows_on_a_tiny_target():
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(1, [6, 9], target.config.vocab_size)
    rows = experts.touch_rows(target, drafter, prompts, [3, 12], new_tokens=10)
    c = target.config
    by = {(r["method"], r["budget"]): r for r in rows}
    assert list(by) == [
        ("autoregressive", 0),
        ("dflash", drafter.block_size - 1),
        ("ddtree", 3),
        ("ddtree", 12),
    ]
    decode = by["autoregressive", 0]
    assert decode["tokens"] == 1 and decode["distinct_mean"] == c.num_experts_per_tok  # N = 1 touches k
    assert decode["forwards"] == 2 * 9  # the first token comes from the prefill
    assert by["dflash", drafter.block_size - 1]["tokens"] == drafter.block_size
    assert by["ddtree", 3]["tokens"] == 4 and by["ddtree", 12]["tokens"] == 13
    for r in rows:
        assert c.num_experts_per_tok <= r["distinct_min_layer"] <= r["distinct_mean"]
        assert r["distinct_mean"] <= r["distinct_max_layer"] <= c.n_routed_experts
        assert r["uniform"] == pytest.approx(experts.uniform_touched(8, 2, r["tokens"]))
    table = experts.markdown(rows)
    assert "E = 8 routed experts, k = 2 per token" in table and table.count("| ddtree |") == 2


# --- the nano bench path ---------------------------------------------------------------------------------


def test_prompt_batches_cycle_to_fill_each_batch():
    prompts = [[1], [2, 2], [3, 3, 3]]
    assert e2e_nano.prompt_batches(prompts, 1) == [[[1]], [[2, 2]], [[3, 3, 3]]]
    assert e2e_nano.prompt_batches(prompts, 2) == [[[1], [2, 2]], [[3, 3, 3], [1]]]
    assert e2e_nano.prompt_batches(prompts, 4) == [[[1], [2, 2], [3, 3, 3], [1]]]


def test_batch_defaults():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert e2e.batch_sizes(_args("--target", "nano"), cpu) == [1]
    assert e2e.batch_sizes(_args("--target", "nano"), cuda) == [1, 4, 16, 64]
    assert e2e.batch_sizes(_args(), cuda) == [1, 4, 16, 64]
    assert e2e.batch_sizes(_args("--target", "nano", "--batch", "2", "3"), cpu) == [2, 3]
    with pytest.raises(ValueError, match="--batch"):
        e2e.batch_sizes(_args("--target", "nano", "--batch", "0"), cpu)


def test_nano_bench_rows_on_a_tiny_target(tmp_path):
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(2, [5, 8, 11], target.config.vocab_size)
    args = _args("--target", "nano", "--batch", "1", "2", "--budgets", "4", "16", "--new-tokens", "12",
                 "--temperatures", "0", "0.8", "--out", str(tmp_path))  # fmt: skip
    seen = []
    rows = e2e_nano.bench(
        target, drafter, prompts, args, torch.device("cpu"), on_row=lambda rs, r: seen.append(r)
    )
    assert seen == rows
    keys = {"target", "method", "budget", "temperature", "batch", "requests", "tokens_per_s", "speedup",
            "tau", "forwards_per_token", "equal_to_ar", "round_ms", "stages_ms"}  # fmt: skip
    assert all(keys <= set(r) for r in rows) and all("tokens" not in r for r in rows)
    settings = [(r["batch"], r["temperature"], r["method"], r["budget"]) for r in rows]
    methods = [("autoregressive", 0), ("dflash", 7), ("ddtree", 4), ("ddtree", 16)]
    assert settings == [(b, t, m, n) for b in (1, 2) for t in (0.0, 0.8) for m, n in methods]
    for r in rows:
        assert r["requests"] == (3 if r["batch"] == 1 else 4)  # batch 2 cycles: 2 batches of 2
        assert r["tokens_per_s"] > 0 and r["tau"] >= 1
        if r["temperature"] == 0:
            assert r["equal_to_ar"] == r["requests"]  # greedy float32: token for token
        else:
            assert r["equal_to_ar"] is None
        # batch 2 greedy against each prompt decoded alone at batch 1 (float32: the same tokens)
        assert r["equal_alone"] == (r["requests"] if (r["batch"], r["temperature"]) == (2, 0) else None)
        if r["method"] == "autoregressive":
            assert r["speedup"] == 1.0 and r["tau"] == 1.0
        else:
            ar = next(a for a in rows if a["method"] == "autoregressive"
                      and (a["batch"], a["temperature"]) == (r["batch"], r["temperature"]))  # fmt: skip
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        # a round commits at least one token per request: never more forwards than one per step
        assert 0 < r["forwards_per_token"] <= 1 / r["batch"] + 1e-12
        if r["method"] == "autoregressive":
            assert r["forwards_per_token"] == pytest.approx(1 / r["batch"])
    touches = experts.touch_rows(target, drafter, prompts, args.budgets, args.new_tokens)
    forwards = [{"batch": 1, "stage": "draft", "kernels": 30, "us": 50.0, "over_decode": 0.5}]
    e2e.report(rows, "header line", tmp_path, target="nano", experts=touches, forwards=forwards)
    saved = json.loads((tmp_path / "e2e_nano.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and len(saved["experts"]) == 4
    assert saved["forwards"] == forwards
    md = (tmp_path / "e2e_nano.md").read_text()
    assert md.startswith("header line") and "| 1 | 0 | ddtree | 16 |" in md and "3/3" in md
    assert "Distinct routed experts" in md and "| 1 | draft | - | 30 | 50.0 |" in md


def test_every_run_of_the_bench_uses_the_seed_and_its_setting(monkeypatch):
    calls = []
    timed = e2e.timed_runs

    def recording(target, specs, prompts):
        calls.extend((len(prompts), drafter is None, config) for drafter, config in specs)
        return timed(target, specs, prompts)

    monkeypatch.setattr(e2e, "timed_runs", recording)
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(4, [7, 4, 9], target.config.vocab_size)
    args = _args("--target", "nano", "--batch", "2", "--budgets", "3", "--new-tokens", "6", "--seed", "7",
                 "--temperatures", "0", "0.7")  # fmt: skip
    e2e_nano.bench(target, drafter, prompts, args, torch.device("cpu"))
    assert len(calls) == 2 * 3 * 2  # temperatures x methods x batches of 2 (3 prompts: 2 calls)
    assert all(n == 2 and c.seed == 7 and c.max_new_tokens == 6 and c.stop_tokens == () for n, _, c in calls)
    assert [c.sampling.temperature for _, _, c in calls] == [0.0] * 6 + [0.7] * 6
    # per batch of prompts, every method's Runner (their timed calls alternate)
    methods = [("autoregressive", True), ("dflash", False), ("ddtree", False)]
    assert [(c.method, no_drafter) for _, no_drafter, c in calls[:6]] == methods * 2


def test_equal_to_ar_counts_the_requests_that_match(monkeypatch):
    """A greedy DDTree output that parts from autoregressive decoding in one request is counted out."""
    timed = e2e.timed_runs

    def diverging(target, specs, prompts):
        outs = timed(target, specs, prompts)
        for (_, config), out in zip(specs, outs):
            if config.method == "ddtree":
                out.tokens[1] = out.tokens[1][:-1] + [(out.tokens[1][-1] + 1) % target.config.vocab_size]
        return outs

    monkeypatch.setattr(e2e, "timed_runs", diverging)
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(5, [6, 8, 5], target.config.vocab_size)
    args = _args(
        "--target", "nano", "--batch", "3", "--budgets", "3", "--new-tokens", "5", "--temperatures", "0"
    )
    rows = e2e_nano.bench(target, drafter, prompts, args, torch.device("cpu"))
    assert [(r["method"], r["equal_to_ar"], r["requests"]) for r in rows] == [
        ("autoregressive", 3, 3), ("dflash", 3, 3), ("ddtree", 2, 3),
    ]  # fmt: skip
    assert "| 3 | 0 | ddtree | 3 |" in e2e_nano.markdown(rows, "h") and "| 2/3 |" in e2e_nano.markdown(
        rows, "h"
    )


def test_equal_alone_counts_the_requests_that_match_their_prompt_decoded_alone(monkeypatch):
    """Batch 3 runs prompts 0, 1, 2 then 0, 1, 2 (cycled); a batched output that parts from its prompt's
    batch-1 autoregressive tokens is counted out, in every method's row, although it may equal the
    batch's own autoregressive run."""
    timed = e2e.timed_runs

    def batched_differs(target, specs, prompts):
        outs = timed(target, specs, prompts)
        for out in outs if len(prompts) == 3 else ():
            out.tokens[1] = out.tokens[1][:-1] + [(out.tokens[1][-1] + 1) % target.config.vocab_size]
        return outs

    monkeypatch.setattr(e2e, "timed_runs", batched_differs)
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(5, [6, 8, 5], target.config.vocab_size)
    args = _args("--target", "nano", "--batch", "1", "3", "--budgets", "3", "--new-tokens", "5",
                 "--temperatures", "0")  # fmt: skip
    rows = e2e_nano.bench(target, drafter, prompts, args, torch.device("cpu"))
    assert [(r["batch"], r["method"], r["equal_to_ar"], r["equal_alone"]) for r in rows] == [
        (1, "autoregressive", 3, None), (1, "dflash", 3, None), (1, "ddtree", 3, None),
        (3, "autoregressive", 3, 2), (3, "dflash", 3, 2), (3, "ddtree", 3, 2),
    ]  # fmt: skip
    md = e2e_nano.markdown(rows, "h")
    assert "same alone" in md and "| 3/3 | 2/3 |" in md and "| 3/3 | - |" in md


# --- the small target and the command line --------------------------------------------------------------


def test_small_targets_rows_follow_ar_with_the_stand_in_drafter():
    """bench/e2e_small's rows of one temperature (run on the CPU with a tiny target: the module needs
    CUDA only for its own scaled-down target): autoregressive decoding first, then DFlash, each budget
    and auto, every greedy output equal to AR's (the stand-in drafter is handed AR's continuation)."""
    target = tiny_target()
    prompts = random_prompts(3, [6, 6], target.config.vocab_size)
    args = argparse.Namespace(eager=False, new_tokens=6, impl=None, seed=0, budgets=[4, 8], auto=True)
    rows = e2e_small.bench_temperature(target, prompts, 0.0, args, torch.device("cpu"))
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("autoregressive", 0), ("dflash", 15), ("ddtree", 4), ("ddtree", 8), ("ddtree", "auto"),
    ]  # fmt: skip
    assert all(r["same_as_ar"] for r in rows[1:]) and all(r["tokens_per_s"] > 0 for r in rows)


def test_small_target_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        e2e_small, "random_target", lambda *a, **k: pytest.fail("built the small target on the CPU")
    )
    with pytest.raises(ValueError, match="CUDA GPU"):
        e2e.main(_args("--target", "small"))
    with pytest.raises(ValueError, match="CUDA GPU"):
        e2e.main(_args())  # small is the default
    with pytest.raises(ValueError, match="no CUDA GPU"):
        e2e.main(_args("--target", "nano", "--device", "cuda"))


def test_cli_reports_the_small_target_on_the_cpu(capsys, monkeypatch):
    from kdtree_engine.cli import main

    monkeypatch.setattr(
        e2e_small, "random_target", lambda *a, **k: pytest.fail("built the small target on the CPU")
    )

    assert main(["bench", "e2e", "--target", "small", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdtree-engine bench e2e: --target small:") and "--target nano" in err


@pytest.mark.skipif(not (KIMI_NANO / "config.json").is_file(), reason="the kimi-nano asset is not there")
def test_nano_main_with_the_shipped_target(tmp_path, capsys):
    argv = ["--target", "nano", "--device", "cpu", "--prompts", "1", "--new-tokens", "4", "--budgets", "2",
            "--temperatures", "0", "--drafter", "random", "--out", str(tmp_path)]  # fmt: skip
    assert e2e.main(_args(*argv)) == 0
    out = capsys.readouterr().out
    assert "kimi-nano (8 layers" in out and "random DFlash drafter" in out and "1/1" in out
    saved = json.loads((tmp_path / "e2e_nano.json").read_text())
    assert [(r["method"], r["budget"]) for r in saved["rows"]] == [
        ("autoregressive", 0),
        ("dflash", 15),
        ("ddtree", 2),
    ]
    assert all(r["equal_to_ar"] == 1 for r in saved["rows"])
    assert [r["tokens"] for r in saved["experts"]] == [1, 16, 3]
    assert "forwards" not in saved  # the per-forward costs are measured on CUDA only
    assert saved["experts"][0]["distinct_mean"] == 4  # kimi-nano: top-4 routing, one decode token


def test_nano_missing_drafter_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--drafter random"):
        e2e.main(_args("--target", "nano", "--device", "cpu", "--drafter", str(tmp_path / "none")))


def test_timed_runs_take_tokens_per_second_untimed_and_stages_from_a_timed_call(monkeypatch):
    """Calls on one Runner: compile and capture, stage-timed, then TIMED_CALLS untimed; the returned
    call is the untimed one of median wall time, and carries the stage times of the stage-timed call,
    which ran the same rounds."""
    from kdtree_engine.engine import GenerationConfig, Runner

    timing, walls = [], iter([0.5, 0.3, 0.1, 0.2, 0.4])  # the median neither first, middle nor last
    real = Runner.generate

    def spy(self, prompts, *, stage_timing=True, **kw):
        timing.append(stage_timing)
        out = real(self, prompts, stage_timing=stage_timing, **kw)
        if not stage_timing:
            out.stats.wall_time = next(walls)
        return out

    monkeypatch.setattr(Runner, "generate", spy)
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(6, [5, 7], target.config.vocab_size)
    (out,) = e2e.timed_runs(target, [(drafter, GenerationConfig(max_new_tokens=6, budget=4))], prompts)
    assert timing == [True, True, *[False] * 5] and e2e.TIMED_CALLS == 5
    assert out.stats.wall_time == 0.3  # the median
    assert out.stats.stage_times["verify"] > 0 and out.stats.stage_times["draft"] > 0


def test_the_rows_timed_calls_alternate_after_every_runner_is_warmed(monkeypatch):
    """Every Runner of a comparison is warmed (two calls) before any timed call, and the timed calls go
    in turn (the first of each Runner, then the second of each), so that a drift of the device over the
    run does not fall on the rows run last; each row gets its own Runner's median call."""
    from kdtree_engine.engine import GenerationConfig, Runner

    order, real = [], Runner.generate

    def spy(self, prompts, *, stage_timing=True, **kw):
        order.append((self.config.method, stage_timing))
        return real(self, prompts, stage_timing=stage_timing, **kw)

    monkeypatch.setattr(Runner, "generate", spy)
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(6, [5, 7], target.config.vocab_size)
    specs = [(None, GenerationConfig(method="autoregressive", max_new_tokens=5)),
             (drafter, GenerationConfig(method="ddtree", budget=4, max_new_tokens=5))]  # fmt: skip
    outs = e2e.timed_runs(target, specs, prompts, calls=3)
    warm = [("autoregressive", True), ("autoregressive", True), ("ddtree", True), ("ddtree", True)]
    assert order[:4] == warm and order[4:] == [("autoregressive", False), ("ddtree", False)] * 3
    assert [o.stats.method for o in outs] == ["autoregressive", "ddtree"]


def _auto_calls():
    """scripts/auto_calls.py, loaded by path."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "auto_calls.py"
    spec = importlib.util.spec_from_file_location("auto_calls", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_row_reports_its_choices():
    """--auto adds a DDTree row with budget "auto": its buckets' rounds add up to the row's rounds, and
    the markdown gets the table of predicted and observed tokens per bucket."""
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(8, [6, 9], target.config.vocab_size)
    argv = "--target nano --batch 2 --budgets 4 --new-tokens 12 --temperatures 0 --auto"
    args = _args(*argv.split())
    rows = e2e_nano.bench(target, drafter, prompts, args, torch.device("cpu"))
    auto = rows[-1]
    assert (auto["method"], auto["budget"], auto["equal_to_ar"]) == ("ddtree", "auto", 2)
    assert sum(auto["budgets"].values()) == sum(r["rounds"] for r in auto["budget_report"].values()) > 0
    md = e2e_nano.markdown(rows, "header")
    assert 'Budget "auto"' in md
    assert "| bucket | rounds | predicted | expected | observed | round ms | picked by |" in md
    costs = auto["round_costs"]  # on the CPU a round's own stages are timed (not: a bucket's first, eager)
    assert costs["rounds"] == sum(auto["budgets"].values()) and 0 < costs["measured"] <= costs["rounds"]
    assert 0 < costs["seconds"] < auto["call_s"]
    log = [entry for call in auto["round_log"] for entry in call]  # [bucket, ms, why, E, rate, costs]
    assert Counter(k for k, *_ in log) == Counter({int(k): v for k, v in auto["budgets"].items()})
    assert sum(ms for _, ms, *_ in log if ms is not None) == pytest.approx(costs["seconds"] * 1e3, abs=1e-3)
    weighed = {len(e) for _, _, _, e, *_ in log if e is not None}  # the batch's E at every bucket
    assert len(weighed) == 1 and weighed.pop() >= 2
    for _, _, why, expected, rate, costs in log:  # why the policy picked the round's bucket
        assert why in PICK_REASONS and (expected is None) == (why == "stepping")
        assert expected is None or min(expected) >= 1.0  # at least the bonus token of one running request
        ruled = why in ("rule", "untried", "explore")  # the rule's rate and prices, in tokens/ms and ms
        assert (rate is not None) == ruled and (costs is None or len(costs) == len(expected))
    for r in rows:  # per call (prompt group), the same groups in every row: tokens, ms, rounds, text
        assert [n for n, *_ in r["call_log"]] == [24]  # two prompts, batch 2, 12 tokens: one group
        assert sum(ms for _, ms, *_ in r["call_log"]) == pytest.approx(r["call_s"] * 1e3, abs=1e-2)
        assert sum(k for _, _, k, _ in r["call_log"]) == r["round_costs"]["rounds"]
    # greedy in float32 on the CPU, every row decodes autoregressive decoding's text: one digest
    assert len({r["call_log"][0][3] for r in rows}) == 1
    lines = _auto_calls().setting_lines(rows)  # scripts/auto_calls.py: auto call by call
    assert len(lines) == 3 and lines[0].startswith("batch 2, temperature 0.0: auto ")
    assert lines[1].startswith("  call 0: auto ") and f"in {auto['call_log'][0][2]} rounds" in lines[1]
    assert lines[1].endswith("auto's text also ar dflash 4")
    assert lines[2].startswith("  same text as ") and " in 1 of 1 calls: auto " in lines[2]
    for r in rows[:-1]:  # every budget's rounds are measured alike, autoregressive decoding's too
        assert r["round_log"] is None
        c = r["round_costs"]
        assert 0 < c["measured"] <= c["rounds"] and 0 < c["seconds"] < r["call_s"]
    assert "| rounds | measured | measured ms | call ms | measured / call | rest ms |" in md


def test_auto_calls_compares_auto_with_the_best_row_on_the_calls_of_the_same_text():
    """scripts/auto_calls.py's last line of a setting: auto against the best row on the calls whose texts'
    digests agree (there neither row's text is luckier); none for a result without digests."""
    script = _auto_calls()

    def row(method, budget, tokens_per_s, calls):
        return {"method": method, "budget": budget, "batch": 1, "temperature": 0.0,
                "tokens_per_s": tokens_per_s, "call_log": calls}  # fmt: skip

    auto = row("ddtree", "auto", 90.0, [[8, 10.0, 4, "a"], [8, 30.0, 9, "b"], [8, 12.0, 5, "c"]])
    best = row("ddtree", 32, 100.0, [[8, 9.0, 4, "a"], [8, 15.0, 5, "x"], [8, 12.0, 5, "c"]])
    ar = row("autoregressive", 0, 30.0, [[8, 40.0, 8, "a"], [8, 40.0, 8, "b"], [8, 40.0, 8, "c"]])
    lines = script.setting_lines([ar, best, auto])
    assert lines[-1] == "  same text as 32 in 2 of 3 calls: auto 22.00 ms, 32 21.00 ms (0.955)"
    assert lines[2].endswith("auto's text also ar")  # call 1: the best row decoded another text
    for r in (auto, best, ar):
        r["call_log"] = [entry[:3] for entry in r["call_log"]]
    assert not script.setting_lines([ar, best, auto])[-1].startswith("  same text")
