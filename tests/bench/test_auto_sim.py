"""The auto-budget simulator's model (bench/auto_sim.py): a larger tree never accepts less on the same
round, an autoregressive step commits one token, a fixed call costs its rounds; and the policy, run in
it, settles on autoregressive decoding when every tree is dear and on speculation when trees are cheap."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kdtree_engine.bench import auto_sim
from kdtree_engine.engine.budget import AUTO_BUCKETS

COSTS = {0: 1.0, 4: 1.1, 8: 1.2, 16: 1.3, 32: 1.5, 64: 2.0}


def _scenario(batch: int = 8, **kw) -> auto_sim.Scenario:
    return auto_sim.Scenario("test", batch, kw.pop("costs", COSTS), **kw)


@pytest.mark.parametrize("seed", range(4))
def test_a_larger_tree_never_accepts_less_on_the_same_round(seed):
    sc = _scenario(batch=32, skill_mean=1.0, cost_noise=0.0)
    counts = []
    for n in AUTO_BUCKETS:
        rng = np.random.default_rng(seed)
        reqs = auto_sim._new_requests(sc, rng)
        got, sums, would = auto_sim._round(sc, reqs, n, rng)
        if n == 0:
            assert got.tolist() == [1] * sc.batch and np.isnan(sums).all() and np.isnan(would).all()
            continue
        counts.append(got)
        # what each smaller tree would have committed is what its own round commits on the same round
        for j, earlier in enumerate(counts):
            assert would[:, j + 1].tolist() == earlier.tolist()
        built = [k for k in AUTO_BUCKETS if k <= n]
        assert not np.isnan(sums[:, : len(built)]).any() and np.isnan(sums[:, len(built) :]).all()
        assert (np.diff(sums[:, 1 : len(built)], axis=1) >= 0).all()  # S grows with the bucket
        assert (got >= 1).all() and (got <= 1 + auto_sim.DEPTH[n]).all()
    assert all((b >= a).all() for a, b in zip(counts, counts[1:]))


def test_a_fixed_call_costs_its_rounds():
    sc = _scenario(batch=4, cost_noise=0.0)
    ar = auto_sim.run_call(sc, 0, 0)
    assert ar["rounds"] == sc.tokens - 1 and ar["seconds"] == pytest.approx((sc.tokens - 1) * 1e-3)
    tree = auto_sim.run_call(sc, 0, 16)
    assert tree["seconds"] == pytest.approx(tree["rounds"] * 1.3e-3) and set(tree["picks"]) == {16}


def test_auto_settles_on_autoregressive_decoding_when_every_tree_is_dear():
    """One request, trees at 2-4 autoregressive steps and little accepted: auto steps
    autoregressively but for a call's first round, the draft every 4 (L + 1) steps (the drafter's context
    holds no more) and its exploration."""
    dear = {0: 1.0, 4: 2.0, 8: 2.2, 16: 2.5, 32: 3.0, 64: 4.0}
    r = auto_sim.compare(_scenario(batch=1, costs=dear, skill_mean=-3.0), seeds=2)
    assert r["best"] == "autoregressive" and r["auto_over_ar"] > 0.9
    assert r["picks"][0] > 0.7 * sum(r["picks"].values())


def test_on_a_static_batch_where_speculation_does_not_pay_auto_steps():
    """Batch 64, sampled-like: speculation commits more tokens per second summed over the running
    requests, but the call waits for its last request. Told each request's tokens left (as generate()
    tells it), auto steps autoregressively (engine.budget_call); without that it drafts and loses."""
    sc = next(s for s in auto_sim.SCENARIOS if s.name == "batch 64, sampled-like")
    told = auto_sim.compare(sc, seeds=4)
    assert told["best"] == "autoregressive" and told["auto_over_best"] >= 0.95
    assert told["picks"][0] > 0.9 * sum(told["picks"].values())
    assert auto_sim.compare(sc, seeds=4, static=False)["auto_over_best"] < 0.9


def test_auto_speculates_when_trees_are_cheap():
    cheap = {0: 1.0, **{k: 1.05 for k in AUTO_BUCKETS if k}}
    r = auto_sim.compare(_scenario(costs=cheap, skill_mean=2.0, persistence=0.9), seeds=2)
    assert r["auto_over_ar"] > 2.0 and r["picks"].get(0, 0) < 0.1 * sum(r["picks"].values())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bucket_accepts_what_the_largest_tree_accepts_among_its_first_nodes(temperature):
    """What scripts/record_acceptance_traces.py relies on: the tree of budget k is the first k nodes of
    the budget-64 tree, and accepting on it commits counts_at_buckets of the 64-tree's accepted path,
    greedy and sampled (the same target token drawn at each node)."""
    import torch

    from kdtree_engine.engine.sampling import SamplingParams, accept_tokens
    from kdtree_engine.tree import build_tree_from_logits

    gen = torch.Generator().manual_seed(3)
    batch, depth, vocab = 8, 8, 6
    draft = torch.randn(batch, depth, vocab, generator=gen) * 2.0
    big = build_tree_from_logits(draft, 64, impl="ref")
    # the target's logits at each node favour one child's token, so that paths run deep
    logits = torch.randn(batch, 65, vocab, generator=gen)
    for b in range(batch):
        for i in range(65):
            kids = (big.parents[b, 1:] == i).nonzero().flatten()
            if kids.numel():
                logits[b, i, big.tokens[b, kids[0]]] += 4.0
    params = SamplingParams(temperature=temperature)
    whole = accept_tokens(big, logits, params, seed=7, offset=0, impl="ref")
    counts = [auto_sim.counts_at_buckets(whole.accepted[b].numpy()) for b in range(batch)]
    assert max(c[-1] for c in counts) >= 4  # deep paths: the test has something to cut
    for j, k in enumerate(AUTO_BUCKETS):
        if k == 0:
            continue
        small = build_tree_from_logits(draft, k, impl="ref")
        assert torch.equal(small.tokens, big.tokens[:, :k]) and torch.equal(
            small.parents, big.parents[:, : k + 1]
        )
        acc = accept_tokens(small, logits[:, : k + 1], params, seed=7, offset=0, impl="ref")
        assert acc.accept_len.tolist() == [c[j] for c in counts]


def test_traces_replay_by_text_position(tmp_path):
    rounds = [{"counts": [1, 2, 3, 3, 3, 3], "sums": [0, 1, 2, 2, 2, 2]},
              {"counts": [1, 1, 1, 2, 4, 5], "sums": [0, 0.5, 1, 1.5, 3, 4]}]  # fmt: skip
    path = tmp_path / "traces.json"
    path.write_text(json.dumps({"buckets": list(AUTO_BUCKETS), "temperatures": {"0": [rounds, []]}}))
    (trace,) = auto_sim.load_traces(path, "0")  # the empty request is dropped
    assert trace.starts.tolist() == [0, 3] and trace.length == 8
    assert [trace.at(p) for p in (0, 2, 3, 7, 8, 11)] == [0, 0, 1, 1, 0, 1]  # wraps past the end
    sc = auto_sim.Scenario("t", 1, COSTS, traces=(trace,), tokens=12, cost_noise=0.0)
    assert auto_sim.run_call(sc, 0, 0)["rounds"] == 11


def test_the_benchs_requests_cycle_the_first_traces_from_their_start_in_every_call(tmp_path):
    """bench_prompts: requests as `bench e2e --prompts N` makes them, trace b % N from its first
    token, whatever the seed; without it, random traces from random positions."""
    one = [{"counts": [1, 2, 3, 3, 3, 3], "sums": [0, 1, 2, 2, 2, 2]}] * 4
    path = tmp_path / "traces.json"
    path.write_text(
        json.dumps({"buckets": list(AUTO_BUCKETS), "temperatures": {"0": [one] * 3, "1": [one] * 3}})
    )
    bench = auto_sim.trace_scenarios(path, {4: COSTS}, bench_prompts=2)[0]
    assert bench.bench_prompts == 2 and "the bench's 2 prompts" in bench.name
    for seed in (0, 1):
        reqs = auto_sim._new_requests(bench, np.random.default_rng(seed))
        assert reqs.trace.tolist() == [0, 1, 0, 1] and reqs.offset.tolist() == [0, 0, 0, 0]
    plain = auto_sim.trace_scenarios(path, {4: COSTS})[0]
    drawn = [auto_sim._new_requests(plain, np.random.default_rng(seed)) for seed in range(8)]
    assert any(r.trace.tolist() != [0, 1, 0, 1] or r.offset.any() for r in drawn)
    # the policy is told the greedy copies, as generate() tells it; sampled requests draw their own
    sampled = auto_sim.trace_scenarios(path, {4: COSTS}, bench_prompts=2)[1]
    assert bench.greedy and not sampled.greedy
    assert auto_sim.copies(bench) == [0, 1, 0, 1] and auto_sim.copies(sampled) is None
    assert auto_sim.copies(plain) is None
    assert auto_sim.bench_groups(bench) == 1 and auto_sim.bench_groups(plain) == 1
    # batch 1 on 3 prompts: the bench's 3 calls, each on its own prompt from its first token
    alone = auto_sim.Scenario("b1", 1, COSTS, traces=bench.traces, bench_prompts=3, greedy=True)
    assert auto_sim.bench_groups(alone) == 3
    assert [auto_sim._new_requests(alone, np.random.default_rng(0), g).trace.tolist() for g in range(3)] == [
        [0],
        [1],
        [2],
    ]
    assert auto_sim.copies(alone, 2) == [0]
    # batch 2 on 3 prompts: calls (0, 1) and (2, 0)
    pairs = auto_sim.Scenario("b2", 2, COSTS, traces=bench.traces, bench_prompts=3, greedy=True)
    assert auto_sim.bench_groups(pairs) == 2
    assert auto_sim._new_requests(pairs, np.random.default_rng(0), 1).trace.tolist() == [2, 0]


def test_traces_with_the_chain_replay_its_rounds_and_tell_its_sums(tmp_path):
    """Greedy traces holding the chain's counts: the scenarios get the chain's bucket (its cost bucket
    16's unless given), a tree round tells the chain's S but not its count, the chain's round its own
    count and S only; traces without the chain keep the tree buckets; fixed and auto calls run."""
    chain = [{"count": 4, "censored": False, "sum": 2.5}, {"count": 2, "censored": True, "sum": 1.0}]
    rounds = [{"counts": [1, 2, 3, 3, 3, 3], "sums": [0, 1, 2, 2, 2, 2], "chain": chain[0]},
              {"counts": [1, 1, 1, 2, 4, 5], "sums": [0, 0.5, 1, 1.5, 3, 4], "chain": chain[1]}]  # fmt: skip
    plain = [{k: v for k, v in r.items() if k != "chain"} for r in rounds]
    path = tmp_path / "traces.json"
    data = {"buckets": list(AUTO_BUCKETS), "temperatures": {"0": [rounds], "1": [plain]}}
    path.write_text(json.dumps(data))
    scenarios = auto_sim.trace_scenarios(path, {1: COSTS}, chain=15)
    greedy, sampled = scenarios
    assert greedy.buckets == (0, 4, 8, 15, 16, 32, 64) and greedy.costs_ms[15] == COSTS[16]
    assert sampled.buckets == AUTO_BUCKETS and "chain" in greedy.name and "chain" not in sampled.name
    reqs = auto_sim._Requests(np.zeros(1), np.zeros(1), trace=np.array([0]), offset=np.array([0]))
    reqs.committed[:] = 1  # text position 0: the first round
    counts, sums, would = auto_sim._trace_round(greedy, reqs, 15)
    assert counts.tolist() == [4] and sums[0, 3] == 2.5 and would[0, 3] == 4
    assert np.isnan(np.delete(sums[0], 3)).all() and np.isnan(np.delete(would[0], 3)).all()
    counts, sums, would = auto_sim._trace_round(greedy, reqs, 16)
    assert (
        counts.tolist() == [3] and sums[0].tolist()[:5] == [0, 1, 2, 2.5, 2] and np.isnan(sums[0, 5:]).all()
    )
    assert np.isnan(would[0, [0, 3, 5, 6]]).all() and would[0, [1, 2, 4]].tolist() == [2, 3, 3]
    r = auto_sim.compare(dataclasses.replace(greedy, tokens=24), calls=2, seeds=1)
    assert "bucket 15" in r["rates"] and r["rates"]["auto"] > 0


def test_recorded_traces_hold_a_round_per_commit_at_every_tree_bucket():
    """scripts/record_acceptance_traces.py on a tiny pair whose drafter has a chain bucket (L = 7): per
    request, rounds whose largest-bucket counts add up to its tokens, S and counts at the tree buckets
    only (the chain's column dropped): S 0 at bucket 0 and growing with the bucket, counts too."""
    from kdtree_engine.engine import GenerationConfig, SamplingParams
    from tests.bench.scripts import load_script
    from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target

    script = load_script("record_acceptance_traces")
    target, drafter = tiny_target(), tiny_drafter(block_size=8)
    prompts = random_prompts(5, [6, 9], target.config.vocab_size)
    config = GenerationConfig(
        budget="auto", max_new_tokens=12, seed=0, sampling=SamplingParams(temperature=0.0)
    )
    traces = script.record(target, drafter, prompts, config)
    assert len(traces) == 2
    for rounds in traces:
        assert (
            sum(r["counts"][-1] for r in rounds) >= 11
        )  # the prefill commits the first; a last round may overshoot
        for r in rounds:
            assert len(r["counts"]) == len(r["sums"]) == len(AUTO_BUCKETS)
            assert r["sums"][0] == 0.0 and all(a <= b + 1e-6 for a, b in zip(r["sums"], r["sums"][1:]))
            assert r["counts"] == sorted(r["counts"]) and r["counts"][0] == 1


def _bench_row(method, budget, batch, temperature=0.0, measured=None, report=None):
    row = {"method": method, "budget": budget, "batch": batch, "temperature": temperature}
    if measured is not None:  # (rounds measured, their seconds)
        row["round_costs"] = {"rounds": measured[0] + 1, "measured": measured[0], "seconds": measured[1]}
    if report is not None:  # bucket -> seconds, as JSON keeps it (string keys)
        row["budget_report"] = {str(k): {"rounds": 1, "seconds": s} for k, s in report.items()}
    return row


def test_costs_from_a_bench_run_prefer_the_fixed_rows_then_the_policys_own(tmp_path):
    """Each fixed row's measured rounds first (bucket 0: plain decoding; the chain: DFlash's), then
    auto's median per bucket (the chain's included), a tree bucket without either the nearest smaller
    tree's (4 the nearest larger); other temperatures ignored; a bucket no row tells is a ValueError
    naming the file."""
    nan = float("nan")
    rows = [
        _bench_row("autoregressive", 32, 1, measured=(10, 0.005)),
        _bench_row("dflash", 15, 1, measured=(10, 0.009)),
        *[_bench_row("ddtree", k, 1, measured=(10, 0.01 * (1 + k / 64))) for k in (8, 16, 32, 64)],
        _bench_row("ddtree", "auto", 1, report={0: 6e-4, 16: 1.2e-3, 15: 9e-4, 64: nan}),
        _bench_row("ddtree", 8, 1, temperature=1.0, measured=(10, 1.0)),
        _bench_row("autoregressive", 32, 4, measured=(10, 0.006)),
        _bench_row("ddtree", "auto", 4, report={8: 1e-3, 32: 1.5e-3, 64: 2e-3}),
    ]
    path = tmp_path / "e2e_nano.json"
    path.write_text(json.dumps({"header": "", "rows": rows}))
    costs = auto_sim.costs_from_bench(path)
    assert list(costs) == [1, 4] and list(costs[1]) == sorted((*AUTO_BUCKETS, 15))
    assert costs[1] == pytest.approx({0: 0.5, 4: 1.125, 8: 1.125, 15: 0.9, 16: 1.25, 32: 1.5, 64: 2.0})
    assert costs[4] == pytest.approx({0: 0.6, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.5, 64: 2.0})
    path.write_text(json.dumps({"header": "", "rows": rows[-1:]}))  # no step measured at batch 4
    with pytest.raises(ValueError, match="e2e_nano.json: no cost for buckets \\[0\\]"):
        auto_sim.costs_from_bench(path)


def _path_target(path: tuple[int, ...], chain: list[int], vocab: int, salt: int) -> int:
    """A greedy target that is a function of the token path alone (as a model's argmax is): it follows
    the draft's chain for a while, then a hash of the path."""
    d = len(path)
    if d < len(chain) and path == tuple(chain[:d]) and hash((path, salt)) % 5:
        return chain[d]
    return hash((path, salt)) % vocab


def _tree_targets(tree, r: int, chain: list[int], vocab: int) -> list[int]:
    """_path_target at every node of request r's tree (the root's path empty)."""
    paths: list[tuple[int, ...]] = [()]
    for j in range(1, tree.tokens.shape[1] + 1):
        p = int(tree.parents[r, j])
        paths.append(paths[p] + (int(tree.tokens[r, j - 1]),) if p >= 0 else ())
    return [_path_target(p, chain, vocab, salt=r) for p in paths]


@pytest.mark.parametrize("seed", range(6))
def test_chain_count_from_a_tree_round_is_the_chains_own_unless_censored(seed):
    """chain_count on a best-first tree equals the chain tree's own greedy acceptance against a target
    that depends on the path only; where censored it is a lower bound. Small trees (censoring) and a
    tree of 64 nodes."""
    import torch

    from kdtree_engine.engine.stages import chain_of
    from kdtree_engine.tree import accept_greedy, build_tree, logits_topk

    gen = torch.Generator().manual_seed(seed)
    b, depth, vocab = 12, 7, 10
    logits = torch.randn(b, depth, vocab, generator=gen) * 2
    outcomes = set()
    for n in (4, 16, 64):
        lp, ids = logits_topk(logits, n, impl="ref")
        tree, chain_tree = build_tree(lp, ids, n, impl="ref"), chain_of(ids[..., 0])
        for r in range(b):
            chain = ids[r, :, 0].tolist()
            own_targets = torch.tensor([_tree_targets(chain_tree, r, chain, vocab)]).expand(b, -1)
            want = int(accept_greedy(chain_tree, own_targets, impl="ref").accept_len[r])
            targets = np.array(_tree_targets(tree, r, chain, vocab))
            got, censored = auto_sim.chain_count(tree.parents[r].numpy(), tree.tokens[r].numpy(), targets,
                                                 ids[r, :, 0].numpy())  # fmt: skip
            assert got <= want if censored else got == want, (n, r, got, want, censored)
            outcomes.add((censored, got > 1))
    assert {(False, True), (False, False), (True, True)} <= outcomes  # exact, at the first position, censored
