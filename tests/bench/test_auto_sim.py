"""The auto-budget simulator's model (bench/auto_sim.py): a larger tree never accepts less on the same
round, an autoregressive step commits one token, a fixed call costs its rounds; and the policy, run in
it, settles on autoregressive decoding when every tree is dear and on speculation when trees are cheap."""

from __future__ import annotations

import numpy as np
import pytest

from kdtree_engine.bench import auto_sim
from kdtree_engine.engine.budget import AUTO_BUCKETS

COSTS = {0: 1.0, 4: 1.1, 8: 1.2, 16: 1.3, 32: 1.5, 64: 2.0}


def _scenario(batch: int = 8, **kw) -> auto_sim.Scenario:
    return auto_sim.Scenario("test", batch, kw.pop("costs", COSTS), kw.pop("plain", 1.0), **kw)


@pytest.mark.parametrize("seed", range(4))
def test_a_larger_tree_never_accepts_less_on_the_same_round(seed):
    sc = _scenario(batch=32, skill_mean=1.0, cost_noise=0.0)
    counts = []
    for n in AUTO_BUCKETS:
        rng = np.random.default_rng(seed)
        reqs = auto_sim._new_requests(sc, rng)
        got, sums = auto_sim._round(sc, reqs, n, rng) if n else (None, None)
        if n == 0:
            got, sums = auto_sim._round(sc, reqs, 0, rng)
            assert got.tolist() == [1] * sc.batch and np.isnan(sums).all()
            continue
        counts.append(got)
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
