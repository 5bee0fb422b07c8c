"""The DFlash drafter training recipe (kdtree_engine.train.drafter) on a tiny random target, float32, CPU:
the parallel training forward against the inference drafter, the loss, the pool of target continuations,
and train_drafter end to end with resume."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kdtree_engine.drafter import DFlashDrafter, load_drafter, random_drafter, tiny_drafter_config
from kdtree_engine.model import greedy_generate, load_model, random_model, tiny_config
from kdtree_engine.train.drafter import (
    Batch,
    DrafterTrainConfig,
    PoolSpec,
    block_labels,
    build_pool,
    chain_acceptance,
    dflash_loss,
    learning_rate,
    loss_weights,
    sample_anchors,
    sample_windows,
    target_features,
    train_drafter,
    train_step,
    training_logits,
)

LAYERS = (0, 2)
VOCAB = 128


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(), seed=0).requires_grad_(False)


def _drafter(target, seed: int = 1, block_size: int = 4):
    return random_drafter(
        tiny_drafter_config(target.config, block_size=block_size, target_layer_ids=LAYERS), seed
    )


def _tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------- training forward


@pytest.mark.parametrize("batch", [1, 3])
def test_training_logits_equal_inference_draft(target, batch):
    """Block j of the parallel forward == DFlashDrafter.draft on a fresh cache with the context rows < a,
    bonus x[a] at start a; the anchors include the smallest (prompt_len - 1) and largest (S - 1 - L)."""
    drafter = _drafter(target)
    prompt_len, s, t = 4, 15, drafter.block_size
    lo, hi = prompt_len - 1, s - t
    tokens = _tokens(batch, s, seed=batch)
    features = target_features(target, tokens, LAYERS)
    gen = torch.Generator().manual_seed(batch)
    anchors = torch.cat([sample_anchors(batch, 3, lo, hi, gen), torch.tensor([[lo, hi]]).expand(batch, 2)], 1)
    anchors[0, :2] = torch.tensor([hi, lo])  # other orders in other rows
    logits = training_logits(drafter, target, tokens, features, anchors)
    assert logits.shape == (batch, 5, t - 1, VOCAB) and logits.dtype == torch.float32
    for j in range(anchors.shape[1]):
        a = anchors[:, j]
        bonus = tokens.gather(1, a[:, None])[:, 0]
        context = features[:, : int(a.max())]
        want = drafter.draft(target, context, a, bonus, a, drafter.new_cache(batch, s + t))
        torch.testing.assert_close(logits[:, j], want, rtol=1e-5, atol=1e-5)


def test_training_gradients_reach_every_drafter_parameter(target):
    drafter = _drafter(target).train()
    tokens = _tokens(2, 12)
    features = target_features(target, tokens, LAYERS)
    anchors = torch.tensor([[3, 8], [5, 4]])
    loss = dflash_loss(
        training_logits(drafter, target, tokens, features, anchors), block_labels(tokens, anchors, 3), 7.0
    )
    loss.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_block_labels_are_the_tokens_after_the_anchor():
    tokens = torch.arange(20).view(2, 10) * 3
    labels = block_labels(tokens, torch.tensor([[0, 6], [2, 3]]), 3)
    assert labels.tolist() == [[[3, 6, 9], [21, 24, 27]], [[39, 42, 45], [42, 45, 48]]]


def test_loss_weights_decay_and_normalization():
    torch.testing.assert_close(
        loss_weights(4, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])
    )
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 3, 4, 11, generator=gen), torch.randint(0, 11, (2, 3, 4), generator=gen)
    for gamma in (0.5, 7.0):
        w = [math.exp(-k / gamma) for k in range(4)]
        ce = [
            [
                float(torch.nn.functional.cross_entropy(logits[b, a, k], labels[b, a, k]))
                for b in range(2)
                for a in range(3)
            ]
            for k in range(4)
        ]
        want = sum(wk * sum(c) / len(c) for wk, c in zip(w, ce)) / sum(w)
        assert float(dflash_loss(logits, labels, gamma)) == pytest.approx(want, rel=1e-5)
    # The same cross-entropy at every position: the normalized loss is that value for any gamma.
    flat = torch.zeros(2, 3, 4, 11)
    assert float(dflash_loss(flat, labels, 0.3)) == pytest.approx(math.log(11), rel=1e-6)


def test_chain_acceptance_counts_leading_hits_plus_bonus():
    labels = torch.tensor([[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]])
    guesses = torch.tensor([[[1, 2, 0, 4], [0, 2, 3, 4], [1, 2, 3, 4]]])
    logits = torch.nn.functional.one_hot(guesses, 5).float()
    assert chain_acceptance(logits, labels).tolist() == [[3.0, 1.0, 5.0]]


def test_overfitting_one_batch_lowers_the_loss(target):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config(target.config, block_size=4, target_layer_ids=LAYERS))
    tokens = _tokens(4, 14, seed=5)
    batch = Batch(
        tokens, target_features(target, tokens, LAYERS), sample_anchors(4, 3, 3, 10, torch.Generator())
    )
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = [float(train_step(drafter, target, batch, opt, gamma=7.0, grad_clip=1.0)) for _ in range(30)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_sample_anchors_range_distinct_and_seeded():
    a = sample_anchors(200, 4, 3, 9, torch.Generator().manual_seed(0))
    assert a.min() == 3 and a.max() == 9
    assert all(len(set(row)) == 4 for row in a.tolist())
    assert torch.equal(a, sample_anchors(200, 4, 3, 9, torch.Generator().manual_seed(0)))
    many = sample_anchors(5, 6, 2, 3, torch.Generator())  # more anchors than positions: with replacement
    assert many.shape == (5, 6) and set(many.unique().tolist()) <= {2, 3}


def test_learning_rate_warmup_then_cosine_to_ten_percent(tmp_path):
    cfg = DrafterTrainConfig(target="t", data="d", out="o", lr=1e-3, warmup_steps=10, max_steps=110)
    assert learning_rate(cfg, 0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9) == pytest.approx(1e-3)
    assert learning_rate(cfg, 60) == pytest.approx(0.55e-3)
    assert learning_rate(cfg, 110) == pytest.approx(1e-4)
    timed = replace(cfg, max_steps=None, minutes=1.0)
    assert learning_rate(timed, 50, seconds=60.0) == pytest.approx(1e-4)


# ---------------------------------------------------------------------------------------------- pool


def _source(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, VOCAB, size=n).astype(np.uint16)


def test_greedy_pool_continues_with_the_target_and_captures_its_features(target):
    source = _source(500, 0)
    spec = PoolSpec(sequences=5, prompt_len=5, new_tokens=6, sampled_fraction=0.0, batch=3)
    pool = build_pool(target, source, spec, LAYERS, seed=7, progress=False)
    assert pool.tokens.shape == (5, 11) and pool.features.shape == (5, 11, 2 * target.config.hidden_size)
    prompts = sample_windows(source, 5, 5, np.random.default_rng(7))
    assert pool.tokens[:, :5].tolist() == prompts.tolist()
    assert pool.tokens[:, 5:].tolist() == greedy_generate(target, prompts.tolist(), 6)
    direct = target(pool.tokens, target.new_cache(5, 11), capture_layers=LAYERS).hidden
    torch.testing.assert_close(pool.features, direct, rtol=1e-5, atol=1e-5)


def test_sampled_pool_rows_are_seeded_draws(target):
    source = _source(500, 1)
    spec = PoolSpec(sequences=4, prompt_len=5, new_tokens=8, sampled_fraction=0.5, batch=4)
    pool = build_pool(target, source, spec, LAYERS, seed=3, progress=False)
    greedy = greedy_generate(target, pool.tokens[:, :5].tolist(), 8)
    new = pool.tokens[:, 5:].tolist()
    assert new[2:] == greedy[2:]  # the rest greedy
    assert new[0] != greedy[0] and new[1] != greedy[1]  # the first half sampled
    again = build_pool(target, source, spec, LAYERS, seed=3, progress=False)
    assert torch.equal(again.tokens, pool.tokens)


# ------------------------------------------------------------------------------------------- the run


def _save_target(model, path: Path) -> Path:
    """An HF-style folder (config.json + model.safetensors) that load_model reads."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    state = {
        (k if k.startswith("lm_head") else f"model.{k}"): v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target):
    """(target folder, data folder) with a tiny train.bin / heldout.bin (eos 0 between documents)."""
    root = tmp_path_factory.mktemp("train_drafter")
    target_dir = _save_target(target, root / "target")
    ids = torch.tensor([[5, 9, 2, 7]])
    torch.testing.assert_close(
        load_model(target_dir)(ids, target.new_cache(1, 4)).logits, target(ids, target.new_cache(1, 4)).logits
    )
    data = root / "data"
    data.mkdir()
    for name, n, seed in (("train.bin", 3000, 0), ("heldout.bin", 600, 1)):
        tokens = _source(n, seed)
        tokens[::50] = 0
        tokens.tofile(data / name)
    (data / "manifest.json").write_text(
        json.dumps({"eos_token_id": 0, "mask_token_id": 1, "vocab_size": VOCAB})
    )
    return target_dir, data


def _config(folders, out: Path, **changes) -> DrafterTrainConfig:
    target_dir, data = folders
    cfg = DrafterTrainConfig(
        target=str(target_dir),
        data=str(data),
        out=str(out),
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        block_size=4,
        target_layer_ids=LAYERS,
        max_steps=3,
        batch_size=4,
        anchors_per_seq=3,
        lr=1e-2,
        pool_sequences=8,
        prompt_len=6,
        new_tokens=8,
        pool_batch=8,
        heldout_sequences=4,
        eval_every=2,
        device="cpu",
        checkpoint_every_s=3600.0,
    )
    return replace(cfg, **changes)


def _state(out: Path) -> dict:
    return torch.load(out / "trainer_state.pt", weights_only=True)


def test_train_drafter_end_to_end_and_resume(folders, tmp_path):
    out = train_drafter(_config(folders, tmp_path / "a"))
    assert out == tmp_path / "a"
    drafter = load_drafter(out)
    assert drafter.config.block_size == 4 and drafter.config.target_layer_ids == LAYERS
    assert drafter.config.mask_token_id == 1 and drafter.config.hidden_size == 64
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["steps"]] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["lr"] > 0 for r in log["steps"])
    assert [r["step"] for r in log["heldout"]] == [2, 3]
    assert all(1.0 <= r["acceptance"] <= 4.0 and math.isfinite(r["loss"]) for r in log["heldout"])
    assert _state(out)["step"] == 3
    pytest.importorskip("matplotlib")
    assert (out / "loss.png").stat().st_size > 0

    resumed = train_drafter(_config(folders, out, max_steps=5, resume=True))
    log2 = json.loads((resumed / "train_log.json").read_text())
    assert [r["step"] for r in log2["steps"]] == [1, 2, 3, 4, 5]
    assert log2["steps"][:3] == log["steps"]
    assert _state(out)["step"] == 5
    # The resumed run is the run that never stopped: same pool, batches, optimizer state.
    straight = train_drafter(_config(folders, tmp_path / "b", max_steps=5))
    log3 = json.loads((straight / "train_log.json").read_text())
    assert [r["loss"] for r in log3["steps"]] == pytest.approx([r["loss"] for r in log2["steps"]], rel=1e-5)
    for (name, p), q in zip(
        load_drafter(straight).state_dict().items(), load_drafter(resumed).state_dict().values()
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(load_drafter(resumed).fc.weight, drafter.fc.weight)


def test_minutes_budget_stops_cleanly(folders, tmp_path):
    out = train_drafter(_config(folders, tmp_path / "m", max_steps=None, minutes=0.003))
    state = _state(out)
    assert state["step"] >= 1 and state["seconds"] >= 0.18
    load_drafter(out)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_size": 1}, "block_size"),
        ({"anchors_per_seq": 0}, "anchors_per_seq"),
        ({"sampled_fraction": 1.5}, "sampled_fraction"),
        ({"new_tokens": 2}, "new_tokens"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"gamma": 0.0}, "gamma"),
        ({"max_steps": None, "minutes": None}, "max_steps"),
    ],
)
def test_bad_config_value_names_the_field(folders, tmp_path, change, field):
    with pytest.raises(ValueError, match=f"DrafterTrainConfig.{field}"):
        _config(folders, tmp_path, **change)


def test_bad_inputs_name_the_field(folders, tmp_path):
    with pytest.raises(ValueError, match="DrafterTrainConfig.data"):
        train_drafter(_config(folders, tmp_path / "o", data=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="DrafterTrainConfig.target"):
        train_drafter(_config(folders, tmp_path / "o", target=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="DrafterTrainConfig.resume"):
        train_drafter(_config(folders, tmp_path / "o", resume=True))
    with pytest.raises(ValueError, match="DrafterTrainConfig.target_layer_ids"):
        train_drafter(_config(folders, tmp_path / "o", target_layer_ids=(0, 4)))
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "heldout.bin"):
        shutil.copy(folders[1] / name, data / name)
    (data / "manifest.json").write_text(json.dumps({"eos_token_id": 0, "vocab_size": VOCAB}))
    with pytest.raises(ValueError, match=r"DrafterTrainConfig.data: .*mask_token_id"):
        train_drafter(_config(folders, tmp_path / "o", data=str(data)))
