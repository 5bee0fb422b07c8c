"""bench/forward_cost.py (bench e2e's per-forward costs): the roofline's bytes counted by hand on a tiny
target, forward and draft calls that repeat the same work, the table; on CUDA (gpu) the rows of a tiny
target and drafter."""

from __future__ import annotations

import math

import pytest
import torch

from kdtree_engine.bench import e2e_small, forward_cost
from tests.engine.helpers import tiny_drafter, tiny_target


def _param_bytes(model, prefix: str = "") -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefix))


def test_forward_bytes_counted_by_hand():
    model = tiny_target()  # float32; 3 layers, 2 of them MoE with 8 routed experts; latent 40
    c = model.config
    b, t, prefix = 2, 5, 7
    every = forward_cost.forward_bytes(model, b, t, prefix, [c.n_routed_experts] * 2)
    embed = _param_bytes(model, "embed_tokens.")
    assert every["weights"] + every["experts"] == _param_bytes(model) - embed + b * t * c.hidden_size * 4
    some = forward_cost.forward_bytes(model, b, t, prefix, [2, 5])
    per_expert = (2 * c.moe_intermediate_size * c.hidden_size + c.hidden_size * c.moe_intermediate_size) * 4
    assert some["experts"] == 7 * per_expert and some["weights"] == every["weights"]
    assert some["cache"] == c.num_hidden_layers * b * (prefix + 2 * t) * c.latent_dim * 4
    layer_io, logits = 2 * c.num_hidden_layers * b * t * c.hidden_size * 4, b * t * c.vocab_size * 4
    assert some["activations"] == layer_io + logits
    assert some["total"] == sum(some[k] for k in ("weights", "experts", "cache", "activations"))


def test_forward_bytes_wants_one_count_per_moe_layer():
    with pytest.raises(ValueError, match="^touched: expected 2 MoE layers, got 3"):
        forward_cost.forward_bytes(tiny_target(), 1, 1, 4, [2, 2, 2])


@pytest.mark.parametrize("tokens", [1, 4])
def test_forward_call_repeats_the_same_forward(tokens):
    model = tiny_target()
    forward = forward_cost.forward_call(model, 2, tokens, 6, impl="ref", capture=(0,))
    first, second = forward(), forward()
    assert first.logits.shape == (2, tokens, model.config.vocab_size)
    assert torch.equal(first.logits, second.logits)
    assert (second.hidden is None) == (tokens == 1)  # a verify captures the drafter's layers


def test_draft_call_repeats_the_same_round():
    target, drafter = tiny_target(), tiny_drafter()
    reset, draft = forward_cost.draft_call(drafter, target, 3, 10, impl="ref")
    first = draft()
    reset()
    assert first.shape == (3, drafter.block_size - 1, target.config.vocab_size)
    assert torch.equal(draft(), first)


def _cost_rows() -> list[dict]:
    decode = {
        "batch": 1,
        "stage": "decode",
        "tokens": 1,
        "kernels": 90,
        "us": 100.0,
        "roofline_us": 40.0,
        "over_roofline": 2.5,
        "experts_per_layer": 4.0,
        "over_decode": 1.0,
        "copy_GBps": 4000.0,
    }
    verify = dict(
        decode,
        stage="verify",
        tokens=17,
        kernels=95,
        us=150.0,
        roofline_us=60.0,
        over_roofline=2.5,
        experts_per_layer=12.5,
        over_decode=1.5,
    )
    draft = {"batch": 1, "stage": "draft", "kernels": 30, "us": 50.0, "over_decode": 0.5}
    return [decode, verify, draft]


def test_markdown_rows():
    table = forward_cost.markdown(_cost_rows(), "the stand-in")
    assert "copy bandwidth measured in this run, 4000 GB/s" in table and "draft: the stand-in" in table
    assert "| 1 | decode | 1 | 90 | 100.0 | 40.0 | 2.50x | 4.00 | 1.00x |" in table
    assert "| 1 | verify | 17 | 95 | 150.0 | 60.0 | 2.50x | 12.50 | 1.50x |" in table
    assert "| 1 | draft | - | 30 | 50.0 | - | - | - | 0.50x |" in table


def test_small_rows_take_their_costs():
    greedy = {"temperature": 0.0}
    rows = [{"method": "autoregressive", "budget": 0, "tokens_per_s": 100.0, "tau": 1.0, **greedy},
            {"method": "ddtree", "budget": 16, "tokens_per_s": 250.0, "tau": 3.0, **greedy}]  # fmt: skip
    e2e_small._add_costs(rows, _cost_rows())
    ar, tree = rows
    assert (ar["speedup"], ar["c_N_over_c_1"], ar["efficiency"]) == (1.0, 1.0, 1.0)
    assert tree["c_N_over_c_1"] == 1.5 and tree["ideal"] == 2.0 and tree["efficiency"] == 1.25
    assert tree["decode_ms"] == 0.1 and tree["roofline_ms"] == 0.04


@pytest.mark.gpu
def test_cost_rows_on_a_tiny_target():
    from kdtree_engine.bench.timing import device_copy_bandwidth
    from kdtree_engine.drafter import random_drafter, tiny_drafter_config
    from kdtree_engine.model import random_model, tiny_config

    target = random_model(tiny_config(), seed=0, dtype=torch.bfloat16, device="cuda")  # as test_gpu.py
    config = tiny_drafter_config(target.config, block_size=16)
    drafter = random_drafter(config, seed=1, dtype=torch.bfloat16, device="cuda")
    bw = device_copy_bandwidth(nbytes=1 << 28)
    rows = forward_cost.cost_rows(target, drafter, 2, [4, 9, 4], 20, None, bw)
    assert [(r["stage"], r.get("tokens")) for r in rows] == [
        ("decode", 1), ("verify", 4), ("verify", 9), ("draft", None),
    ]  # fmt: skip
    c = target.config
    for r in rows:
        assert r["kernels"] > 0 and math.isfinite(r["us"]) and r["us"] > 0
        if r["stage"] != "draft":
            assert c.num_experts_per_tok <= r["experts_per_layer"] <= c.n_routed_experts
            assert r["roofline_us"] == pytest.approx(r["bytes"]["total"] / bw * 1e6)
    assert rows[0]["over_decode"] == 1.0


@pytest.fixture
def host_timed(monkeypatch):
    """forward_cost's GPU timer and kernel count replaced by the host timer and a stand-in count, so that
    its plumbing runs on the CPU."""
    from kdtree_engine.bench import timing

    monkeypatch.setattr(forward_cost, "time_graph", lambda fn: timing.time_host(fn, reps=1))
    monkeypatch.setattr(forward_cost, "count_kernels", lambda fn: 7)


def test_cost_rows_plumbing_on_the_cpu(host_timed):
    target, drafter = tiny_target(), tiny_drafter()
    rows = forward_cost.cost_rows(target, drafter, 2, [5, 3], 12, "ref", 1e9)
    assert [(r["stage"], r.get("tokens")) for r in rows] == [
        ("decode", 1), ("verify", 3), ("verify", 5), ("draft", None),
    ]  # fmt: skip
    c = target.config
    for r in rows[:3]:
        assert c.num_experts_per_tok <= r["experts_per_layer"] <= c.n_routed_experts
        assert r["roofline_us"] == pytest.approx(r["bytes"]["total"] / 1e9 * 1e6) and r["kernels"] == 7
    assert rows[0]["experts_per_layer"] <= 2 * c.num_experts_per_tok  # a decode step: 2 rows of k experts
    assert all(r["us"] > 0 and r["over_decode"] == r["us"] / rows[0]["us"] for r in rows)


def test_small_batch_rows_on_a_tiny_target(host_timed):
    """bench e2e --target small's per-batch path (generate runs, stand-in drafter, costs) on a tiny CPU
    target, at temperature 0 and 1: every row has its cost columns, c(N)/c(1) from the verify of
    N = budget + 1, and its speedup against the autoregressive row of its own temperature."""
    import argparse

    from kdtree_engine.bench import e2e

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(
        ["--budgets", "4", "--prompt-len", "6", "--new-tokens", "8", "--temperatures", "0", "1"]
    )
    args.copy_bw = 1e9
    rows, costs = e2e_small.bench_batch(tiny_target(), 2, args, torch.device("cpu"))
    methods = [("autoregressive", 0), ("dflash", 15), ("ddtree", 4)]
    assert [(r["temperature"], r["method"], r["budget"]) for r in rows] == [
        (t, *m) for t in (0.0, 1.0) for m in methods
    ]
    assert [c.get("tokens") for c in costs] == [1, 5, 16, None]
    verify = {c["tokens"]: c["us"] for c in costs if c["stage"] != "draft"}
    ar = {r["temperature"]: r["tokens_per_s"] for r in rows if r["method"] == "autoregressive"}
    for r in rows:
        assert r["batch"] == 2 and r["speedup"] == r["tokens_per_s"] / ar[r["temperature"]]
        assert r["c_N_over_c_1"] == (verify[r["budget"] + 1] / verify[1] if r["budget"] else 1.0)
        assert r["roofline_ms"] == costs[0]["roofline_us"] * 1e-3
    assert all(r.get("same_as_ar", True) for r in rows[:3])  # greedy float32: the stand-in equals AR
    text = e2e_small.markdown(rows, "h", costs)
    assert "Per forward" in text and "| 2 | 1 | ddtree | 4 |" in text


def test_nano_costs_per_batch_size(host_timed, monkeypatch):
    """bench e2e --target nano's cost rows: per batch size the decode step, a verify of DFlash's block and
    of budget + 1 per budget, and the draft, on a prefix of the mean prompt length + half the new tokens."""
    import argparse

    from kdtree_engine.bench import e2e, e2e_nano, timing

    monkeypatch.setattr(timing, "device_copy_bandwidth", lambda device: 2e9)
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(
        ["--target", "nano", "--batch", "1", "2", "--budgets", "3", "7", "--new-tokens", "6"]
    )
    target, drafter = tiny_target(), tiny_drafter()  # block size 8: DFlash verifies 8, budget 7 too
    rows = e2e_nano.costs(target, drafter, [[1] * 5, [2] * 9], args, torch.device("cpu"))
    stages = [("decode", 1), ("verify", 4), ("verify", 8), ("draft", None)]
    assert [(r["batch"], r["stage"], r.get("tokens")) for r in rows] == [
        (b, *s) for b in (1, 2) for s in stages
    ]
    assert args.copy_bw == 2e9 and all(r["copy_GBps"] == 2.0 for r in rows if r["stage"] != "draft")
    assert rows[0]["bytes"]["cache"] == forward_cost.forward_bytes(target, 1, 1, 7 + 3, [1, 1])["cache"]
