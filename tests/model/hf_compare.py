"""Shared helpers: the same tiny random weights in transformers' DeepseekV3ForCausalLM and in ours.

Run as a script to print the max logit differences per config (the table in docs/model.md):
    PYTHONPATH=src:. python tests/model/hf_compare.py
"""

from __future__ import annotations

import functools

import torch

from kdtree_engine.attention import tree_mla_attention
from kdtree_engine.model import ModelConfig, tiny_config
from kdtree_engine.model.loader import model_from_hf_tensors
from kdtree_engine.model.testing import randomize_

YARN = dict(
    rope_type="yarn",
    rope_factor=4.0,
    rope_original_max_position_embeddings=16,
    max_position_embeddings=64,
    rope_mscale=0.8,
    rope_mscale_all_dim=0.7,
    rope_beta_fast=8.0,
    rope_beta_slow=2.0,
)
# Each config covers a different corner; together: q_lora_rank null and set, n_group > 1 with
# topk_group < n_group, yarn on and off, first_k_dense_replace 0 / 1 / 2, shared experts 1 and 2,
# interleaved and half-split rope, attention biases, norm_topk_prob on and off, tied and untied lm_head.
CONFIGS: dict[str, dict] = {
    "base": dict(),
    "qnull_yarn_dense0": dict(q_lora_rank=None, first_k_dense_replace=0, **YARN),
    "dense2_shared2_g4k2_bias": dict(
        first_k_dense_replace=2,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        rope_interleave=False,
        attention_bias=True,
    ),
    "kimi_like_tied": dict(
        model_type="kimi_k2",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.7,
        tie_word_embeddings=True,
        num_experts_per_tok=3,
        **YARN,
    ),
}


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV3Config

    d = cfg.to_hf_dict()
    d.pop("model_type")
    return DeepseekV3Config(**d)


@functools.lru_cache(maxsize=16)
def hf_pair(name: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """(transformers model, our model) with identical random weights; ours is built from the HF
    in-memory state dict (fused expert tensors), i.e. through our loader's name mapping."""
    from transformers import DeepseekV3ForCausalLM

    cfg = tiny_config(**CONFIGS[name])
    hf = DeepseekV3ForCausalLM._from_config(
        hf_config(cfg), attn_implementation="sdpa", experts_implementation="eager"
    )
    randomize_(hf, seed)
    hf = hf.to(dtype).eval()
    ours = model_from_hf_tensors(cfg, iter(hf.state_dict().items()), dtype)
    return hf, ours


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """Plain full forward of one sequence: [len(tokens), vocab]."""
    return hf(torch.tensor([tokens])).logits[0]


@functools.cache
def attention_is_float64() -> bool:
    """Whether the public attention op keeps float64 inputs in float64 (the ref computes in float32 on
    upcast inputs; then our float64 logits carry float32 attention rounding, about 1e-6)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 6, generator=gen, dtype=torch.float64)
    kv = torch.randn(1, 3, 6, generator=gen, dtype=torch.float64)
    try:
        out, _ = tree_mla_attention(q, kv, torch.tensor([3]), softmax_scale=0.5, d_v=4, impl="ref")
    except ValueError:  # the op does not take float64 at all: the model runs attention in float32
        return False
    p = torch.softmax(0.5 * q[0, 0, 0] @ kv[0].T, dim=-1)
    return bool((out[0, 0, 0] - p @ kv[0, :, :4]).abs().max() < 1e-13)


def tolerance(dtype: torch.dtype) -> float:
    """Allowed max |diff| / max |logit|.

    transformers' float64 model computes RMSNorm statistics, rope cos/sin and the router in float32
    (we do the same). The router's float32 GEMM can round a row differently for a different number of
    tokens (14 tree rows vs a 15-token sequence): one float32 ulp in a routing weight, about 1e-7 in
    the logits. Everything else agrees to about 1e-14 when the attention op runs float64.
    """
    if dtype == torch.float64:
        return 1e-6 if attention_is_float64() else 2e-5
    return 1e-5


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max())


def report() -> None:
    from tests.model.test_vs_hf import scenario_diffs

    print(f"attention op float64-capable: {attention_is_float64()}")
    print("| config | dtype | full | prefill+decode | tree verify | compact+decode | ragged | max |logit| |")
    print("|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        for dtype in (torch.float64, torch.float32):
            d = scenario_diffs(name, dtype)
            cells = " | ".join(f"{d[k]:.1e}" for k in ("full", "decode", "tree", "compact", "ragged"))
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {cells} | {d['scale']:.2f} |")


if __name__ == "__main__":
    report()
