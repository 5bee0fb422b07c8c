"""The drafter training run and command (kdtree_engine.train.drafter) on a tiny random target, float32,
CPU: the learning-rate schedule, train_drafter end to end with resume and a time budget, and the errors
that name a config field."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kdtree_engine.drafter import load_drafter
from kdtree_engine.model import load_model, random_model, tiny_config
from kdtree_engine.train.drafter import DrafterTrainConfig, learning_rate, train_drafter

LAYERS = (0, 2)
VOCAB = 128


def test_learning_rate_warmup_then_cosine_to_ten_percent(tmp_path):
    cfg = DrafterTrainConfig(target="t", data="d", out="o", lr=1e-3, warmup_steps=10, max_steps=110)
    assert learning_rate(cfg, 0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9) == pytest.approx(1e-3)
    assert learning_rate(cfg, 60) == pytest.approx(0.55e-3)
    assert learning_rate(cfg, 110) == pytest.approx(1e-4)
    timed = replace(cfg, max_steps=None, minutes=1.0)
    assert learning_rate(timed, 50, seconds=60.0) == pytest.approx(1e-4)


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
def folders(tmp_path_factory):
    """(target folder, data folder): a tiny random target, and a tiny train.bin / heldout.bin of random
    ids (eos 0 between documents)."""
    root = tmp_path_factory.mktemp("train_drafter")
    target = random_model(tiny_config(), seed=0)
    target_dir = _save_target(target, root / "target")
    ids = torch.tensor([[5, 9, 2, 7]])
    torch.testing.assert_close(
        load_model(target_dir)(ids, target.new_cache(1, 4)).logits, target(ids, target.new_cache(1, 4)).logits
    )
    data = root / "data"
    data.mkdir()
    for name, n, seed in (("train.bin", 3000, 0), ("heldout.bin", 600, 1)):
        tokens = np.random.default_rng(seed).integers(2, VOCAB, size=n).astype(np.uint16)
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
    if importlib.util.find_spec("matplotlib") is not None:
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


def test_the_stages_import_only_the_stages_before_them():
    """pool, objective, config, step, checkpoint, the run: imported in this order in a fresh interpreter,
    each loads no drafter training module but itself (no circle, no stage reaching forward)."""
    order = "drafter_pool drafter_objective drafter_config drafter_step drafter_checkpoint drafter".split()
    code = (
        "import importlib, sys\n"
        "loaded = lambda: {m for m in sys.modules if m.startswith('kdtree_engine.train.drafter')}\n"
        f"for name in {order!r}:\n"
        "    before = loaded()\n"
        "    importlib.import_module('kdtree_engine.train.' + name)\n"
        "    print(name, sorted(m.split('.')[-1] for m in loaded() - before))\n"
    )
    src = str(Path(__file__).parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [f"{name} ['{name}']" for name in order]
