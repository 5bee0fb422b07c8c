"""A tiny random model for tests and the demo (no downloads): `tiny_config()` + `random_model()`."""

from __future__ import annotations

from typing import Any

import torch

from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.model import DeepseekV3ForCausalLM


def tiny_config(**overrides: Any) -> ModelConfig:
    """4 layers (1 dense + 3 MoE), hidden 64, 4 heads, latent 32 + rope 8, 8 experts in 2 groups
    (keep 1), top-2, 1 shared expert, yarn off, vocab 128. Any field can be overridden."""
    fields: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def per_expert_tensors(name: str, t: torch.Tensor):
    """Stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as their per-expert checkpoint
    tensors (name, view), so that a seeded init does not depend on the storage layout."""
    prefix, kind = name.rsplit(".", 1)
    for e in range(t.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            gate, up = t[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Seeded in-place init with O(1) activations: Linear / expert weights N(0, 1/fan_in), embeddings
    N(0, 1), norm weights 1 + N(0, 0.1^2), e_score_correction_bias N(0, 0.1^2). Works for our model and
    for transformers' (tensors are visited in name order, stacked experts as their per-expert checkpoint
    tensors, so the values depend on checkpoint names and shapes only)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in model.named_parameters():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and t.dim() == 3:
            tensors.update(per_expert_tensors(name, t))
        else:
            tensors[name] = t
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name in sorted(tensors):
        t = tensors[name]
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        if name.endswith("norm.weight") or "layernorm" in name:
            value = 1 + 0.1 * noise
        elif name.endswith("e_score_correction_bias"):
            value = 0.1 * noise
        elif "embed_tokens" in name:
            value = noise
        else:
            value = noise * t.shape[-1] ** -0.5
        t.copy_(value.to(t.dtype))
    return model


def random_model(
    config: ModelConfig | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DeepseekV3ForCausalLM:
    """A seeded random DeepseekV3ForCausalLM (tiny_config() by default) in eval mode."""
    model = DeepseekV3ForCausalLM(config or tiny_config())
    randomize_(model, seed)
    return model.to(device=device, dtype=dtype).eval()
