"""Latent cache compaction, forward input checks, captured hidden states, the attention op being used,
greedy generation, and the seeded tiny model."""

from __future__ import annotations

import pytest
import torch

import kdtree_engine.model.context as context
from kdtree_engine.attention import AttentionPlan
from kdtree_engine.model import LatentKVCache, greedy_generate, random_model, tiny_config
from tests.model.hf_compare import hf_pair


def test_compact_moves_rows_in_every_layer() -> None:
    kv = torch.randn(3, 2, 12, 5)
    cache = LatentKVCache(kv.clone(), torch.tensor([10, 9]))
    start = torch.tensor([4, 2])
    keep = torch.tensor([[0, 2, 5, -1], [0, 3, 4, 6]])
    cache.compact(start, keep, torch.tensor([3, 4]))
    assert cache.seqlens.tolist() == [7, 6]
    assert torch.equal(cache.kv[:, 0, :4], kv[:, 0, :4])  # prefix untouched
    assert torch.equal(cache.kv[:, 0, 4:7], kv[:, 0, [4, 6, 9]])
    assert torch.equal(cache.kv[:, 1, :2], kv[:, 1, :2])
    assert torch.equal(cache.kv[:, 1, 2:6], kv[:, 1, [2, 5, 6, 8]])


def test_compact_rejects_bad_input() -> None:
    cache = LatentKVCache(torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="keep"):
        cache.compact(torch.tensor([0, 0]), torch.tensor([[0, -1], [0, 1]]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="max_len"):
        cache.compact(torch.tensor([6, 0]), torch.tensor([[0, 3], [0, 1]]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="compact"):
        cache.compact(torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]))


@pytest.fixture(scope="module")
def model():
    return random_model(seed=3)


def test_forward_rejects_bad_input(model) -> None:
    cache = model.new_cache(2, 8)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    cases = [
        (dict(input_ids=ids.int()), "input_ids"),
        (dict(input_ids=torch.zeros(2, 9, dtype=torch.int64)), "max_len"),
        (dict(positions=torch.zeros(2, 2, dtype=torch.int64)), "positions"),
        (dict(visibility=torch.ones(2, 3, 3)), "visibility"),
        (dict(lengths=torch.tensor([3, 4])), "lengths"),
        (dict(capture_layers=(4,)), "capture_layers"),
    ]
    for kwargs, word in cases:
        args = {"input_ids": ids, "cache": cache, **kwargs}
        with pytest.raises(ValueError, match=word):
            model(**args)
    assert cache.seqlens.tolist() == [0, 0]


def test_every_forward_plans_its_attention_once(model, monkeypatch) -> None:
    """One attention plan per forward (validation, kernel choice, schedule), run by every layer."""
    plans, runs = [], []
    real_plan, real_run = context.plan_attention, AttentionPlan.run

    def spy_plan(q, kv, seqlens, **kw):
        plans.append((tuple(q.shape), seqlens.tolist(), kw["visibility"].shape, kw["impl"]))
        return real_plan(q, kv, seqlens, **kw)

    def spy_run(self, q, kv):
        runs.append(tuple(q.shape))
        return real_run(self, q, kv)

    monkeypatch.setattr(context, "plan_attention", spy_plan)
    monkeypatch.setattr(AttentionPlan, "run", spy_run)
    cache = model.new_cache(1, 10)
    model(torch.tensor([[5, 6, 7]]), cache, impl="ref")
    model(torch.tensor([[8]]), cache, impl="ref")
    c = model.config
    assert len(plans) == 2 and len(runs) == 2 * c.num_hidden_layers
    assert plans[0] == ((1, 3, c.num_attention_heads, c.latent_dim), [3], (1, 3, 3), "ref")
    assert plans[1][:2] == ((1, 1, c.num_attention_heads, c.latent_dim), [4])


@torch.no_grad()
def test_capture_layers_are_decoder_layer_outputs() -> None:
    hf, ours = hf_pair("base", torch.float64)
    ids = torch.randint(0, ours.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    out = ours(ids, ours.new_cache(1, 8), capture_layers=(2, 0))
    ref = hf(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, layer 1, ...]
    h = ours.config.hidden_size
    assert out.hidden.shape == (1, 8, 2 * h)
    assert torch.allclose(out.hidden[..., :h], ref[3], atol=1e-5)
    assert torch.allclose(out.hidden[..., h:], ref[1], atol=1e-5)
    assert ours(ids, ours.new_cache(1, 8)).hidden is None


@torch.no_grad()
def test_generate_equals_full_recompute_greedy() -> None:
    hf, ours = hf_pair("dense2_shared2_g4k2_bias", torch.float64)
    prompts = [[3, 9, 27, 81, 115, 90], [7], [12, 40, 2]]
    got = greedy_generate(ours, prompts, 6)
    for p, g in zip(prompts, got):
        seq = list(p)
        for _ in range(6):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert g == seq[len(p) :]
    stop = got[0][2]
    early = greedy_generate(ours, torch.tensor([prompts[0]]), 6, eos_token_id=stop)[0]
    assert early == got[0][: got[0].index(stop) + 1]
    assert greedy_generate(ours, prompts, 0) == [[], [], []]


def test_random_model_is_seeded() -> None:
    a, b, c = random_model(seed=5), random_model(seed=5), random_model(seed=6)
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    cfg = tiny_config()
    assert cfg.first_k_dense_replace == 1 < cfg.num_hidden_layers and cfg.n_group > cfg.topk_group
    assert greedy_generate(a, [[1, 2, 3]], 5) == greedy_generate(b, [[1, 2, 3]], 5)


def test_logits_rows_keeps_one_row_per_request(model) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([6, 3])
    full = model(ids, model.new_cache(2, 8), lengths=lengths).logits  # [2, 6, V]
    rows = model(ids, model.new_cache(2, 8), lengths=lengths, logits_rows=lengths - 1).logits
    assert rows.shape == (2, 1, model.config.vocab_size)
    torch.testing.assert_close(rows[:, 0], full[torch.arange(2), lengths - 1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="logits_rows"):
        model(ids, model.new_cache(2, 8), logits_rows=torch.tensor([0, 6]))
