"""load_model on checkpoints written by transformers' save_pretrained (single file and sharded), errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdtree_engine.model import load_model
from tests.model.hf_compare import hf_pair, rel_diff

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path, object]:
    """("base" float32 model saved as one file, the same model sharded, the transformers model)."""
    hf, _ = hf_pair("base", torch.float32)
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(single)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    return single, sharded, hf


def _logits_close(model, hf) -> float:
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return rel_diff(model(ids, model.new_cache(2, 9)).logits, hf(ids).logits)


def test_single_file_and_sharded_load(saved) -> None:
    single, sharded, hf = saved
    assert (single / "model.safetensors").is_file()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    names = set(index["weight_map"])
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names  # per-expert layout on disk
    for path in (single, sharded):
        model = load_model(path)
        assert _logits_close(model, hf) < 1e-5


def test_bf16_load_keeps_router_float32(saved) -> None:
    model = load_model(saved[0], dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    ref = load_file(saved[0] / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(gate.e_score_correction_bias, ref)
    model.to(torch.float16)  # a later cast keeps the router too
    assert gate.weight.dtype == torch.float32


def _edit_single(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_mtp_layer_tensors_are_ignored(saved, tmp_path) -> None:
    def add_mtp(t):  # the published checkpoints carry layer num_hidden_layers (the MTP module)
        t["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)

    model = load_model(_edit_single(saved[0], tmp_path / "c", add_mtp))
    assert _logits_close(model, saved[2]) < 1e-5


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"), "missing tensors.*kv_b_proj"),
        (lambda t: t.update({"model.layers.0.mlp.foo.weight": torch.zeros(2)}), "unexpected tensors.*foo"),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(65)}),
            r"norm.weight' has shape \(65,\), expected \(64,\)",
        ),
    ],
    ids=["missing", "extra", "shape"],
)
def test_bad_tensors_raise(saved, tmp_path, edit, match) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(_edit_single(saved[0], tmp_path / "c", edit))


def test_missing_files_raise(saved, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    shutil.copy(saved[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)
    shard_dir = tmp_path / "sharded"
    shutil.copytree(saved[1], shard_dir)
    victim = sorted(shard_dir.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(shard_dir)


def test_bad_paths_name_the_path(saved, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=f"^path: {tmp_path / 'typo'} does not exist$"):
        load_model(tmp_path / "typo")
    with pytest.raises(FileNotFoundError, match="config.json is not a directory"):
        load_model(saved[0] / "config.json")


def _truncate(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


@pytest.mark.parametrize("keep", [0, 7, 100, 5000])
def test_truncated_safetensors_raise_value_error_naming_the_file(saved, tmp_path, keep) -> None:
    shutil.copytree(saved[0], tmp_path / "c")
    _truncate(tmp_path / "c" / "model.safetensors", keep)
    with pytest.raises(ValueError, match=r"c/model.safetensors: not a readable safetensors file \(Error"):
        load_model(tmp_path / "c")


def test_truncated_shard(saved, tmp_path) -> None:
    shutil.copytree(saved[1], tmp_path / "c")
    victim = sorted((tmp_path / "c").glob("model-*.safetensors"))[-1]
    _truncate(victim, 3000)
    with pytest.raises(ValueError, match=f"{victim.name}: not a readable safetensors file"):
        load_model(tmp_path / "c")


@pytest.mark.parametrize(
    "file, text, match",
    [
        (
            "config.json",
            '{"vocab_size": 128,\n "hidden_size": 64,}',
            "config.json: invalid JSON at line 2 column 20",
        ),
        ("config.json", "", "config.json: invalid JSON at line 1 column 1"),
        ("config.json", '"deepseek_v3"', r"config.json: expected a JSON object \{...\}, got a JSON string"),
        ("config.json", b"\xff\xfe{}", "config.json: not a UTF-8 text file"),
        ("model.safetensors.index.json", '{"weight_map": {', "index.json: invalid JSON at line 1 column 17"),
        ("model.safetensors.index.json", '{"metadata": {}}', 'index.json: expected a "weight_map" object'),
    ],
)
def test_broken_json_names_the_file_and_position(saved, tmp_path, file, text, match) -> None:
    shutil.copytree(saved[1], tmp_path / "c")
    target = tmp_path / "c" / file
    target.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path / "c")


def test_config_field_of_the_wrong_type_names_the_file(saved, tmp_path) -> None:
    shutil.copytree(saved[0], tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, "hidden_size": [64]}))
    with pytest.raises(ValueError, match="config.json: unexpected value in the config"):
        load_model(tmp_path / "c")


def test_unsupported_config_value_raises(saved, tmp_path) -> None:
    shutil.copytree(saved[0], tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="longrope"):
        load_model(tmp_path / "c")


def test_tied_embeddings_checkpoint(tmp_path) -> None:
    hf, _ = hf_pair("kimi_like_tied", torch.float32)
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert _logits_close(model, hf) < 1e-5


def _quantize_blocks(w: torch.Tensor, bo: int, bi: int):
    """Block FP8 as in the published DeepSeek-V3 checkpoints: (e4m3 weight, scale_inv, dequantized)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-w.shape[0] // bo), -(-w.shape[1] // bi))
    expect = torch.empty(w.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
            scale[i, j] = w[rows, cols].abs().max() / 448
            q[rows, cols] = (w[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
            expect[rows, cols] = q[rows, cols].float() * scale[i, j]
    return q, scale, expect


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny block-FP8 checkpoint (16 x 24 blocks, partial edge blocks) and the expected weights."""
    from kdtree_engine.model import random_model, tiny_config

    cfg = tiny_config(fp8_block_size=(16, 24))
    tensors, expected = {}, {}
    for key, w in _per_expert_state(random_model(cfg, seed=4)):
        name = key if key.startswith("lm_head") else f"model.{key}"
        quantize = w.dim() == 2 and "proj" in key and w.shape[0] * w.shape[1] > 1
        if quantize:
            tensors[name], tensors[f"{name}_scale_inv"], expected[key] = _quantize_blocks(w, 16, 24)
        else:
            tensors[name], expected[key] = w, w
    path = tmp_path_factory.mktemp("fp8")
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(tensors, path / "model.safetensors")
    return path, expected


def _per_expert_state(model):
    """The model's state as a checkpoint on disk has it: the stacked experts as per-expert tensors."""
    from kdtree_engine.model.testing import per_expert_tensors

    for key, w in model.state_dict().items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield from ((k, t.contiguous()) for k, t in per_expert_tensors(key, w))
        else:
            yield key, w


def test_block_fp8_checkpoint_is_dequantized(fp8_checkpoint) -> None:
    path, expected = fp8_checkpoint
    assert json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        16,
        24,
    ]
    model = load_model(path)
    state = dict(_per_expert_state(model))
    assert state["layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float32
    for key, want in expected.items():
        assert torch.equal(state[key], want), key
    model(torch.tensor([[1, 2, 3]]), model.new_cache(1, 3))


def test_block_fp8_errors(fp8_checkpoint, tmp_path) -> None:
    path, _ = fp8_checkpoint
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(ValueError, match="not paired.*o_proj"):
        load_model(_edit_single(path, tmp_path / "a", lambda t: t.pop(scale)))
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv has shape \(1, 1\)"):
        load_model(_edit_single(path, tmp_path / "b", lambda t: t.update({scale: torch.ones(1, 1)})))
    shutil.copytree(path, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, "quantization_config": None}))
    with pytest.raises(ValueError, match="no quantization_config"):
        load_model(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "compressed-tensors"}})
    )
    with pytest.raises(ValueError, match="quantization_config"):
        load_model(tmp_path / "c")
