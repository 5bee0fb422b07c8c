"""ModelConfig from HF config dicts: both rope spellings, yarn numbers equal to transformers', errors."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.model import ModelConfig, tiny_config
from kdtree_engine.model import rope as our_rope

pytest.importorskip("transformers")

DEEPSEEK_V3 = dict(  # the published config.json, trimmed to what matters here
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    tie_word_embeddings=False,
    attention_bias=False,
    num_nextn_predict_layers=1,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
    ),
)
KIMI_K2 = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "num_attention_heads": 64,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
    "vocab_size": 163840,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": dict(
        type="yarn",
        factor=32.0,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
    ),
}


def _new_spelling(d: dict) -> dict:
    """The same config in transformers >= 5 spelling: rope_parameters with rope_type and rope_theta."""
    d = dict(d)
    rp = dict(d.pop("rope_scaling"))
    rp["rope_type"] = rp.pop("type")
    rp["rope_theta"] = d.pop("rope_theta")
    return {**d, "rope_parameters": rp}


def _hf_rope(d: dict):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        yarn_apply_mscale,
    )

    hc = DeepseekV3Config.from_dict({k: v for k, v in d.items() if k != "model_type"})
    emb = DeepseekV3RotaryEmbedding(hc)
    return emb, yarn_apply_mscale(hc.rope_parameters, hc.qk_head_dim**-0.5)


@pytest.mark.parametrize("d", [DEEPSEEK_V3, KIMI_K2], ids=["deepseek_v3", "kimi_k2"])
def test_both_spellings_and_yarn_match_transformers(d: dict) -> None:
    legacy, new = ModelConfig.from_hf_dict(d), ModelConfig.from_hf_dict(_new_spelling(d))
    assert legacy == new
    assert legacy.rope_type == "yarn" and legacy.latent_dim == 576 and legacy.qk_head_dim == 192
    for spelling in (d, _new_spelling(d)):
        emb, scale = _hf_rope(spelling)
        assert legacy.softmax_scale == pytest.approx(scale, rel=1e-15)
        assert torch.equal(our_rope.inv_freq(legacy), emb.inv_freq)
        assert legacy.rope_cos_sin_scale == emb.attention_scaling
        pos = torch.tensor([[0, 1, 4095, 4096, 100000]])
        cos, sin = our_rope.cos_sin(legacy, our_rope.inv_freq(legacy), pos, torch.float64)
        hf_cos, hf_sin = emb(torch.zeros(1, dtype=torch.float64), pos)
        assert torch.equal(cos, hf_cos[..., :32]) and torch.equal(sin, hf_sin[..., :32])


def test_yarn_variants_match_transformers() -> None:
    """mscale != mscale_all_dim (cos/sin scaled), truncate off; factor implied by the position ratio."""
    base = {**DEEPSEEK_V3, "max_position_embeddings": 16384}
    variants = [
        dict(type="yarn", factor=8.0, mscale=0.9, mscale_all_dim=0.5, original_max_position_embeddings=2048),
        dict(
            type="yarn",
            factor=4.0,
            beta_fast=16,
            beta_slow=2,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ]
    for rs in variants:
        d = {**base, "rope_scaling": rs}
        cfg = ModelConfig.from_hf_dict(d)
        emb, scale = _hf_rope(d)
        assert torch.equal(our_rope.inv_freq(cfg), emb.inv_freq), rs
        assert cfg.rope_cos_sin_scale == pytest.approx(emb.attention_scaling, rel=1e-15), rs
        assert cfg.softmax_scale == pytest.approx(scale, rel=1e-15), rs
    implied = {**base, "rope_scaling": dict(type="yarn", original_max_position_embeddings=4096)}
    assert ModelConfig.from_hf_dict(implied).rope_factor == 4.0  # max_position_embeddings / original


def test_no_yarn_defaults() -> None:
    d = {**DEEPSEEK_V3, "q_lora_rank": None}
    del d["rope_scaling"]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_type == "default" and cfg.q_lora_rank is None
    assert cfg.softmax_scale == 192**-0.5
    emb, _ = _hf_rope(d)
    assert torch.equal(our_rope.inv_freq(cfg), emb.inv_freq)


def test_hf_dict_round_trip() -> None:
    for cfg in (tiny_config(), tiny_config(q_lora_rank=None, rope_type="yarn", rope_factor=4.0)):
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    "change, word",
    [
        (dict(model_type="llama"), "model_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope type"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(n_group=3), "n_group"),
        (dict(topk_group=9), "topk_group"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
    ],
)
def test_unsupported_values_raise(change: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3, **change})
