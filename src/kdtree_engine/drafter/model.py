"""The DFlash drafter: Qwen3-style layers (q/k RMSNorm, GQA, rope) whose keys and values are the target's
context features (fc + RMSNorm over the concatenated hidden states of `target_layer_ids`) followed by
the block [bonus, MASK x L]; attention inside the block is bidirectional. Embeddings and lm_head are the
target's. The drafter's own KV cache keeps only context rows: block rows are recomputed every round.

Dimension names: B batch, C new context rows, T = block_size = L + 1, S cached context rows,
H hidden, F = len(target_layer_ids) * H, h heads, g kv heads, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kdtree_engine.drafter.config import DFlashConfig
from kdtree_engine.impl import check_impl, resolve_impl
from kdtree_engine.model.mla import RMSNorm  # the same norm as Qwen3RMSNorm: float32 statistics


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[d / 2] float32 rotary frequencies, as Qwen3."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, T] int64 -> cos, sin [B, T, 1, d] (non-interleaved halves, as Qwen3)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class DrafterCache:
    """Roped keys and values of the context rows only.

    k, v    [layers, B, max_len + spare, g, d]
    seqlens [B] int64  context rows in use (== the position of the next context row)
    spare   rows past max_len that take the writes of padding context rows (see DFlashDrafter.forward)
    """

    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor
    spare: int = 0

    @property
    def max_len(self) -> int:
        return int(self.k.shape[2]) - self.spare


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, g, d, hid = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(hid, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(hid, g * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(hid, g * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, hid, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.heads, self.kv_heads, self.head_dim = h, g, d

    def queries(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, T, H] -> normed, roped queries [B, T, h, d]."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim))
        return apply_rope(q, cos, sin)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> normed, roped keys and values [B, T, g, d]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, T, h, d], k / v [B, K, g, d], mask [B, T or 1, K] bool (True: visible) -> o_proj of the
        attention output [B, T, H]. Shared by inference and training (kdtree_engine.train.drafter)."""
        b, t = q.shape[:2]
        rep = self.heads // self.kv_heads
        k, v = (z.repeat_interleave(rep, dim=2).transpose(1, 2) for z in (k, v))  # [B, h, K, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, ctx, block_rope, ctx_rope, cache_k, cache_v, slots, key_valid) -> torch.Tensor:
        """x [B, T, H] block, ctx [B, C, H] new context; cache_k/v [B, max_len + spare, g, d] (this
        layer's, context row c of request b written in place at slot slots[b, c]); key_valid [B, S] bool
        over the first S cache slots. Returns [B, T, H]."""
        b, t, _ = x.shape
        q = self.queries(x, *block_rope)  # [B, T, h, d]
        k_blk, v_blk = self.keys_values(x, *block_rope)  # [B, T, g, d]
        k_ctx, v_ctx = self.keys_values(ctx, *ctx_rope)  # [B, C, g, d]
        rows = torch.arange(b, device=x.device)[:, None]
        cache_k[rows, slots] = k_ctx
        cache_v[rows, slots] = v_ctx
        s = key_valid.shape[1]
        k = torch.cat([cache_k[:, :s], k_blk], dim=1)  # [B, S + T, g, d]
        v = torch.cat([cache_v[:, :s], v_blk], dim=1)
        mask = torch.cat([key_valid, key_valid.new_ones(b, t)], dim=1)[:, None, :]  # [B, 1, S + T]
        return self.attend(q, k, v, mask)


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, *attn_args) -> torch.Tensor:
        # As the official layer: the context features are NOT normalized per layer, only the block is.
        x = x + self.self_attn(self.input_layernorm(x), ctx, *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameter names follow the published checkpoints: layers.N.self_attn.q_proj.weight, fc.weight,
    hidden_norm.weight, norm.weight, ... (no embedding, no lm_head: those are the target's)."""

    capturable = True  # draft() reads no tensor on the host: the engine captures it in a CUDA graph

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # float32 per device, not a buffer: .to(bf16)
        self._packed = None  # drafter.packed.PackedWeights of the kernel path, built at its first call

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def new_cache(self, batch_size: int, max_len: int) -> DrafterCache:
        """A cache of max_len context rows per request, plus block_size spare rows for the padding rows
        of a round's context (a round brings at most block_size rows: the accepted nodes and the bonus)."""
        c, p = self.config, self.fc.weight
        spare = c.block_size
        shape = (c.num_hidden_layers, batch_size, max_len + spare, c.num_key_value_heads, c.head_dim)
        return DrafterCache(
            k=p.new_zeros(shape),
            v=p.new_zeros(shape),
            seqlens=torch.zeros(batch_size, dtype=torch.int64, device=p.device),
            spare=spare,
        )

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        """[d / 2] float32 on `device`, as rope_cos_sin computes them (cached: no launch per forward)."""
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.config.head_dim, self.config.rope_theta, device)
        return self._inv_freq[device]

    def uses_kernels(self, impl: str | None, device: torch.device) -> bool:
        """Whether a forward on `device` with `impl` runs the Triton kernels (drafter/fused.py): a kernel
        impl ("triton", "hopper", or None on CUDA) and float32 / bf16 / fp16 weights; else the torch
        reference (float64 always, whatever the device). ValueError naming `impl` for an unknown one,
        or a kernel impl for float32 / bf16 / fp16 off CUDA without the Triton interpreter."""
        check_impl(impl)
        if self.fc.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        return resolve_impl(impl, device) == "triton"

    @torch.no_grad()
    def forward(
        self,
        block_embeds: torch.Tensor,
        context: torch.Tensor,
        context_lens: torch.Tensor,
        start: torch.Tensor,
        cache: DrafterCache,
        impl: str | None = None,
    ) -> torch.Tensor:
        """block_embeds [B, T, H] (target-embedded [bonus, MASK x L]); context [B, C, F] target hidden
        states of the rows since the last call (C may be 0), context_lens [B] int64 real rows per request;
        start [B] int64 position of the bonus token, == cache.seqlens + context_lens.
        Appends the context rows to the cache and returns the final-normed hidden states [B, T, H].

        No host reads (so a round that calls it can be captured in a CUDA graph): every context row is
        written, the padding rows (c >= context_lens[b]) at slots past the request's new length, where
        they stay masked until a real row overwrites them (or in the spare rows), and the block attends
        to the slots below each request's new length.

        impl (kdtree_engine.impl): "ref" runs the torch reference below (SDPA over all max_len slots,
        masked); "triton" / "hopper" / None on CUDA the kernels (drafter/fused.py: the cache read in
        place, about ten launches per layer) for float32 / bf16 / fp16; None off CUDA the reference."""
        if self.uses_kernels(impl, block_embeds.device):
            x = block_embeds.to(self.fc.weight.dtype).clone(memory_format=torch.contiguous_format)
            return self._kernel_forward(x, context, context_lens, start, cache)
        return self._reference_forward(block_embeds, context, context_lens, start, cache)

    def _kernel_forward(self, x, context, context_lens, start, cache) -> torch.Tensor:
        """x [B, T, H] contiguous, the drafter's dtype, overwritten. Imported lazily: triton is optional."""
        from kdtree_engine.drafter.fused import kernel_forward

        return kernel_forward(self, x, context, context_lens, start, cache)

    def _reference_forward(self, block_embeds, context, context_lens, start, cache) -> torch.Tensor:
        b, t, _ = block_embeds.shape
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(context.to(dtype)))  # [B, C, H]
        c = ctx.shape[1]
        ctx_pos = cache.seqlens[:, None] + torch.arange(c, device=ctx.device)  # [B, C]
        slots = ctx_pos.clamp(max=cache.k.shape[2] - 1)  # only padding rows reach the spare rows
        blk_pos = start[:, None] + torch.arange(t, device=ctx.device)  # [B, T]
        new_len = cache.seqlens + context_lens
        key_valid = torch.arange(cache.max_len, device=ctx.device)[None, :] < new_len[:, None]  # [B, S]
        block_rope, ctx_rope = self._rope(blk_pos, dtype), self._rope(ctx_pos, dtype)
        x = block_embeds.to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, block_rope, ctx_rope, cache.k[i], cache.v[i], slots, key_valid)
        cache.seqlens.copy_(new_len)
        return self.norm(x)

    def draft(
        self,
        target,
        context: torch.Tensor,
        context_lens: torch.Tensor,
        bonus: torch.Tensor,
        start: torch.Tensor,
        cache: DrafterCache,
        impl: str | None = None,
    ) -> torch.Tensor:
        """One drafting step. target: the model whose embed_tokens / lm_head the drafter borrows;
        bonus [B] int64 last committed token (not yet in the target cache) at position start [B];
        impl as forward. Returns draft logits [B, L, V] float32 for positions start + 1 .. start + L."""
        b = bonus.shape[0]
        block = bonus.new_full((b, self.block_size), self.config.mask_token_id)
        block[:, 0] = bonus
        embeds = target.embed_tokens(block)  # [B, T, H], a fresh tensor: the kernel path may overwrite it
        if self.uses_kernels(impl, embeds.device):
            x = embeds.to(self.fc.weight.dtype).contiguous()
            with torch.no_grad():
                hidden = self._kernel_forward(x, context, context_lens, start, cache)
        else:
            hidden = self(embeds, context, context_lens, start, cache, impl="ref")
        lm_head = target.lm_head
        return lm_head(hidden[:, 1:].to(lm_head.weight.dtype)).float()
