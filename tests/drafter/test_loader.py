"""DFlash config parsing (published layout) and the safetensors loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kdtree_engine.drafter import (
    DFlashConfig,
    build_target_layer_ids,
    load_drafter,
    random_drafter,
    save_drafter,
    tiny_drafter_config,
)
from kdtree_engine.model import tiny_config

# The layout of the published z-lab DFlash checkpoints (e.g. Qwen3-8B-DFlash-b16), shrunk.
PUBLISHED = {
    "architectures": ["DFlashDraftModel"],
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


def test_published_config():
    c = DFlashConfig.from_hf_dict(PUBLISHED)
    assert (c.block_size, c.draft_len, c.mask_token_id) == (16, 15, 151669)
    assert c.target_layer_ids == (1, 9, 17, 25, 33)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert c.rope_theta == 1e6 and c.num_target_layers == 36
    again = DFlashConfig.from_hf_dict(c.to_hf_dict())
    assert again == c


def test_default_target_layer_ids_follow_the_official_rule():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(36, 1) == (18,)
    d = dict(PUBLISHED, dflash_config={"mask_token_id": 5})
    assert DFlashConfig.from_hf_dict(d).target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dflash_config={"target_layer_ids": [1]}), "mask_token_id"),
        (dict(block_size=1), "block_size"),
        (dict(num_key_value_heads=5), "num_key_value_heads"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling"),
        (dict(use_sliding_window=True), "sliding-window"),
    ],
)
def test_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_hf_dict(dict(PUBLISHED, **change))


def _drafter():
    return random_drafter(tiny_drafter_config(tiny_config(vocab_size=64, hidden_size=32)), seed=9)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_round_trip(tmp_path):
    d = _drafter()
    save_drafter(d, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["mask_token_id"] == 63
    loaded = load_drafter(tmp_path)
    assert loaded.config == d.config
    _same(d, loaded)
    assert load_drafter(tmp_path, dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16


def test_sharded_prefixed_checkpoint_with_shared_tensors(tmp_path):
    d = _drafter()
    (tmp_path / "config.json").write_text(json.dumps(d.config.to_hf_dict()))
    state = {f"model.{k}": v.clone() for k, v in d.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(64, 32)  # shipped copies of the target's tensors are ignored
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _same(d, load_drafter(tmp_path))


def test_missing_and_misshapen_tensors(tmp_path):
    d = _drafter()
    (tmp_path / "config.json").write_text(json.dumps(d.config.to_hf_dict()))
    state = dict(d.state_dict())
    del state["layers.1.self_attn.k_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*k_norm"):
        load_drafter(tmp_path)
    state = dict(d.state_dict())
    state["fc.weight"] = torch.zeros(32, 7)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"^path: {tmp_path / 'nowhere'} does not exist$"):
        load_drafter(tmp_path / "nowhere")


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^path: no config.json in {tmp_path}$"):
        load_drafter(tmp_path)
    save_drafter(_drafter(), tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json is not a directory"):
        load_drafter(tmp_path / "config.json")
    index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard model-00001-of-00002.safetensors named in"):
        load_drafter(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file in"):
        load_drafter(tmp_path)


@pytest.mark.parametrize("keep", [0, 9, 3000])
def test_truncated_safetensors_names_the_file(tmp_path, keep):
    save_drafter(_drafter(), tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:keep])
    with pytest.raises(ValueError, match=f"^{file}: not a readable safetensors file"):
        load_drafter(tmp_path)


@pytest.mark.parametrize(
    "file, text, match",
    [
        ("config.json", '{"block_size": 8,,}', "config.json: invalid JSON at line 1 column 18"),
        ("config.json", "[1, 2]", "config.json: expected a JSON object"),
        ("model.safetensors.index.json", "{\n", "index.json: invalid JSON at line 2 column 1"),
        ("model.safetensors.index.json", '{"weight_map": [1]}', 'index.json: expected a "weight_map" object'),
    ],
)
def test_broken_json_names_the_file_and_position(tmp_path, file, text, match):
    save_drafter(_drafter(), tmp_path)
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.pop("hidden_size"), "config.json: missing required field 'hidden_size'"),
        (lambda c: c.update(dflash_config="mask"), "config.json: unexpected value in the config"),
    ],
)
def test_config_fields_missing_or_of_the_wrong_type_name_the_file(tmp_path, edit, match):
    save_drafter(_drafter(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_drafter(tmp_path)
