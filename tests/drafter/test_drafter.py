"""The DFlash drafter against an independent one-shot reference built from transformers' Qwen3 pieces
(RMSNorm, MLP, rotary embedding), float64: the cached, batched, ragged drafter over several rounds must
give what a cache-free forward over the whole context so far gives."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as q3

from kdtree_engine.drafter import random_drafter
from tests.drafter.tiny import CFG


def _hf_config() -> Qwen3Config:
    return Qwen3Config(
        hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size,
        num_attention_heads=CFG.num_attention_heads,
        num_key_value_heads=CFG.num_key_value_heads,
        head_dim=CFG.head_dim,
        rms_norm_eps=CFG.rms_norm_eps,
        rope_theta=CFG.rope_theta,
    )


class Reference:
    """One request, no cache: keys/values = [context rows (positions 0..S-1); block (S..S+L)]."""

    def __init__(self, drafter) -> None:
        hf = _hf_config()
        self.state = {k: v.double() for k, v in drafter.state_dict().items()}
        self.rope = q3.Qwen3RotaryEmbedding(hf).double()
        self.hf = hf

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        mod = q3.Qwen3RMSNorm(x.shape[-1], eps=CFG.rms_norm_eps).double()
        mod.weight.data = self.state[f"{name}.weight"]
        return mod(x)

    def mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        mod = q3.Qwen3MLP(self.hf).double()
        mod.load_state_dict({k[len(prefix) + 1 :]: v for k, v in self.state.items() if k.startswith(prefix)})
        return mod(x)

    def attention(self, i: int, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        p, s, t, d = f"layers.{i}.self_attn", ctx.shape[0], x.shape[0], CFG.head_dim
        lin = lambda n, z: z @ self.state[f"{p}.{n}.weight"].T  # noqa: E731
        q = self.norm(f"{p}.q_norm", lin("q_proj", x).view(t, -1, d)).transpose(0, 1)[None]
        both = torch.cat([ctx, x])
        k = self.norm(f"{p}.k_norm", lin("k_proj", both).view(s + t, -1, d)).transpose(0, 1)[None]
        v = lin("v_proj", both).view(s + t, -1, d).transpose(0, 1)[None]
        cos, sin = self.rope(k, torch.arange(s + t)[None])
        q, _ = q3.apply_rotary_pos_emb(q, q, cos[:, s:], sin[:, s:])
        _, k = q3.apply_rotary_pos_emb(k, k, cos, sin)
        rep = CFG.num_attention_heads // CFG.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        w = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1)  # bidirectional, no mask
        return lin("o_proj", (w @ v)[0].transpose(0, 1).reshape(t, -1))

    def __call__(self, block: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """block [T, H], context [S, F] -> final-normed hidden [T, H]."""
        ctx = self.norm("hidden_norm", context @ self.state["fc.weight"].T)
        x = block
        for i in range(CFG.num_hidden_layers):
            x = x + self.attention(i, self.norm(f"layers.{i}.input_layernorm", x), ctx)
            x = x + self.mlp(f"layers.{i}.mlp", self.norm(f"layers.{i}.post_attention_layernorm", x))
        return self.norm("norm", x)


@pytest.mark.parametrize("rounds", [[[5, 3], [2, 4], [1, 1], [3, 0]], [[1], [4], [2]]])
def test_cached_ragged_drafter_equals_one_shot_reference(rounds):
    drafter = random_drafter(CFG, seed=3, dtype=torch.float64)
    ref = Reference(drafter)
    b, f = len(rounds[0]), len(CFG.target_layer_ids) * CFG.hidden_size
    gen = torch.Generator().manual_seed(0)
    cache = drafter.new_cache(b, 32)
    history = [torch.zeros(0, f, dtype=torch.float64) for _ in range(b)]
    for lens in rounds:
        c = max(lens)
        context = torch.randn(b, c, f, generator=gen, dtype=torch.float64)
        block = torch.randn(b, CFG.block_size, CFG.hidden_size, generator=gen, dtype=torch.float64)
        lens_t = torch.tensor(lens)
        for r in range(b):
            history[r] = torch.cat([history[r], context[r, : lens[r]]])
        start = torch.tensor([h.shape[0] for h in history])
        out = drafter(block, context, lens_t, start, cache)
        assert cache.seqlens.tolist() == start.tolist()
        for r in range(b):
            torch.testing.assert_close(out[r], ref(block[r], history[r]), rtol=1e-10, atol=1e-10)


def test_context_changes_the_draft_and_padding_does_not():
    drafter = random_drafter(CFG, seed=4)
    f = len(CFG.target_layer_ids) * CFG.hidden_size
    ctx = torch.randn(1, 3, f)
    block = torch.randn(1, CFG.block_size, CFG.hidden_size)
    start = torch.tensor([3])
    base = drafter(block, ctx, torch.tensor([3]), start, drafter.new_cache(1, 8))
    padded = torch.cat([ctx, torch.full((1, 2, f), 1e4)], dim=1)  # garbage rows past the length
    same = drafter(block, padded, torch.tensor([3]), start, drafter.new_cache(1, 8))
    torch.testing.assert_close(base, same)
    other = drafter(block, ctx.flip(1), torch.tensor([3]), start, drafter.new_cache(1, 8))
    assert (base - other).abs().max() > 1e-3


def test_draft_uses_target_embedding_and_lm_head():
    from kdtree_engine.model import random_model, tiny_config

    target = random_model(tiny_config(vocab_size=64, hidden_size=32, num_hidden_layers=3), seed=1)
    drafter = random_drafter(CFG, seed=5)
    f = len(CFG.target_layer_ids) * CFG.hidden_size
    ctx, bonus, start = torch.randn(2, 4, f), torch.tensor([7, 9]), torch.tensor([4, 4])
    logits = drafter.draft(target, ctx, torch.tensor([4, 4]), bonus, start, drafter.new_cache(2, 16))
    assert logits.shape == (2, CFG.block_size - 1, 64) and logits.dtype == torch.float32
    block = torch.full((2, CFG.block_size), CFG.mask_token_id)
    block[:, 0] = bonus
    hidden = drafter(target.embed_tokens(block), ctx, torch.tensor([4, 4]), start, drafter.new_cache(2, 16))
    torch.testing.assert_close(logits, target.lm_head(hidden[:, 1:]))
