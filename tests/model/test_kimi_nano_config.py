"""kimi-nano's config.json carries the DeepSeek keys that SGLang still reads and transformers 5 no longer
writes (moe_layer_freq, topk_method, scoring_func); our loader reads it, and the same checkpoint with the
config as transformers 5 wrote it (without them), alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kdtree_engine.assets import KIMI_NANO
from kdtree_engine.model import load_model
from kdtree_engine.model.config import ModelConfig

SGLANG_KEYS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}

pytestmark = pytest.mark.skipif(not (KIMI_NANO / "config.json").is_file(), reason="no kimi-nano asset")


def _shipped() -> dict:
    return json.loads((KIMI_NANO / "config.json").read_text())


def _copy(tmp_path: Path, config: dict) -> Path:
    """kimi-nano with another config.json (the weight files linked, not copied)."""
    for f in KIMI_NANO.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_shipped_config_carries_sglang_keys() -> None:
    d = _shipped()
    assert {k: d.get(k) for k in SGLANG_KEYS} == SGLANG_KEYS


def test_old_and_new_configs_read_alike() -> None:
    new = _shipped()
    old = {k: v for k, v in new.items() if k not in SGLANG_KEYS}
    legacy = dict(old)  # the pre-transformers-5 rope spelling as well
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = rope
    assert ModelConfig.from_hf_dict(new) == ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(legacy)


@pytest.mark.parametrize("key, value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                        ("moe_layer_freq", 2)])  # fmt: skip
def test_other_values_of_the_new_keys_raise(key: str, value) -> None:
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict({**_shipped(), key: value})


def test_checkpoint_loads_with_either_config(tmp_path: Path) -> None:
    old = {k: v for k, v in _shipped().items() if k not in SGLANG_KEYS}
    ids = torch.tensor([[5, 17, 300, 42]])
    logits = []
    for model in (load_model(KIMI_NANO), load_model(_copy(tmp_path, old))):
        with torch.no_grad():
            logits.append(model(ids, model.new_cache(1, 4)).logits)
    assert torch.equal(logits[0], logits[1])
