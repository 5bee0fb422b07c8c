"""DeepseekV3ForCausalLM in plain PyTorch on the latent KV cache: prefill, decode and tree verify are
one forward (new tokens + explicit positions + a visibility mask among them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kdtree_engine.impl import capturing
from kdtree_engine.model import rope
from kdtree_engine.model.cache import LatentKVCache
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.context import ForwardContext
from kdtree_engine.model.linear import project
from kdtree_engine.model.mla import MLAttention, RMSNorm
from kdtree_engine.model.moe import MLP, MoE


@dataclass
class ForwardOutput:
    """logits [b, t, vocab] float32 (float64 for a float64 model); hidden [b, t, len(capture) * hidden]
    the outputs of the captured decoder layers concatenated in the order asked, or None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(c)
        self.mlp = MoE(c) if c.is_moe_layer(layer_id) else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, h, kv_layer, ctx: ForwardContext):
        """x [b, t, hidden] the residual stream, h = input_layernorm(x) -> (x + attention, the MLP's
        output not yet added): the model adds it with the next norm (one launch on the kernel path)."""
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, kv_layer, ctx), ctx.op_impl)
        return x, self.mlp(h, ctx.op_impl, ctx.row_invariant)


class DeepseekV3ForCausalLM(nn.Module):
    """The target model. Parameter names are the HF checkpoint names without the leading "model."."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # float32 per device, not a buffer: .to(bf16)
        self._causal: dict[tuple[int, torch.device], torch.Tensor] = {}  # small t: no mask launches

    def causal_mask(self, t: int) -> torch.Tensor:
        """[t, t] bool lower-triangular on the model's device; kept for t <= 64 (decode and verify sizes),
        made outside graph capture so that a kept mask never lives in a graph's pool."""
        key = (t, self.device)
        mask = self._causal.get(key)
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
            if t <= 64 and not capturing(self.device):
                self._causal[key] = mask
        return mask

    def rope_inv_freq(self) -> torch.Tensor:
        """[qk_rope_head_dim // 2] float32 on the model's device (kept out of dtype casts)."""
        if self.device not in self._inv_freq:
            self._inv_freq[self.device] = rope.inv_freq(self.config).to(self.device)
        return self._inv_freq[self.device]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_len: int) -> LatentKVCache:
        """An empty latent cache (NaN rows) on the model's device and dtype."""
        c = self.config
        return LatentKVCache.empty(
            c.num_hidden_layers, batch_size, max_len, c.latent_dim, dtype=self.dtype, device=self.device
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: LatentKVCache,
        positions: torch.Tensor | None = None,
        visibility: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        capture_layers: Sequence[int] = (),
        impl: str | None = None,
        logits_rows: torch.Tensor | None = None,
        validate: bool = True,
        row_invariant: bool = False,
    ) -> ForwardOutput:
        """Run t new tokens per request on top of the cached prefix.

        input_ids [b, t] int64; positions [b, t] int64 (default cache.seqlens[:, None] + arange(t));
        visibility [b, t, t] bool among the new tokens (default causal); lengths [b] int64 real new
        tokens per request (default t). Writes the new latent rows at slots seqlens[b] .. seqlens[b]+t-1
        of every layer, then cache.seqlens += lengths. Returns logits and the captured hidden states.
        logits_rows [b] int64, when given, keeps one row per request (e.g. a prompt's last token):
        logits are then [b, 1, V], which saves the [b, t, V] projection of a long prefill.
        validate=False (and CUDA graph capture) skips the checks that read tensor values, so that with a
        kernel impl the forward never waits for the device: cache.seqlens is updated in place.
        row_invariant: on the kernel path, every op computes a token's row with an order that does not
        depend on the rest of the launch (issue 32): a tree node then gets the bits of the same token
        decoded alone after its ancestors, and a request those it gets alone.
        """
        check_values = validate and not capturing(input_ids.device)
        b, t = self._check_inputs(input_ids, cache, positions, visibility, lengths, capture_layers)
        if check_values:
            self._check_values(cache, t, lengths, logits_rows)
        elif logits_rows is not None and logits_rows.shape != (b,):
            raise ValueError(f"logits_rows: expected shape ({b},), got {tuple(logits_rows.shape)}")
        dev = self.device
        start = cache.seqlens.clone()
        if positions is None:
            positions = start[:, None] + torch.arange(t, device=dev)
        if visibility is not None:
            visibility = visibility.to(dev)
        elif not row_invariant:  # the row-invariant attention takes a causal forward as such (no table)
            visibility = self.causal_mask(t).expand(b, t, t)
        x = self.embed_tokens(input_ids.to(dev))  # [b, t, hidden]
        cos, sin = rope.cos_sin(self.config, self.rope_inv_freq(), positions.to(dev), x.dtype)
        ctx = ForwardContext(self.config, impl, start, t, visibility, cos, sin, check_values, row_invariant,
                             cache.rows_hint)  # fmt: skip
        captured, delta = {}, None
        for i, layer in enumerate(self.layers):
            x, h = layer.input_layernorm.add_norm(x, delta, ctx.op_impl)  # x: layer i - 1's output
            captured[i - 1] = x
            x, delta = layer(x, h, cache.kv[i], ctx)
        x, h = self.norm.add_norm(x, delta, ctx.op_impl)  # RMSNorm is per row: the same bits before or after
        captured[len(self.layers) - 1] = x
        if logits_rows is not None:
            h = h[torch.arange(b, device=dev), logits_rows.to(dev)][:, None]  # [b, 1, hidden]
        logits = project(h, self.lm_head, ctx.gemm)
        cache.seqlens.copy_(start + (lengths.to(dev) if lengths is not None else t))
        hidden = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return ForwardOutput(logits.to(torch.promote_types(logits.dtype, torch.float32)), hidden)

    def _check_inputs(
        self, input_ids, cache, positions, visibility, lengths, capture_layers
    ) -> tuple[int, int]:
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(
                f"input_ids: expected [b, t] int64, got {tuple(input_ids.shape)} {input_ids.dtype}"
            )
        b, t = input_ids.shape
        if cache.batch_size != b or cache.kv.shape[0] != self.config.num_hidden_layers:
            raise ValueError(f"cache: expected {self.config.num_hidden_layers} layers and batch {b}")
        if cache.kv.device != self.device:
            raise ValueError(f"cache: on {cache.kv.device}, the model on {self.device}")
        if positions is not None and positions.shape != (b, t):
            raise ValueError(f"positions: expected shape {(b, t)}, got {tuple(positions.shape)}")
        if visibility is not None and (visibility.shape != (b, t, t) or visibility.dtype != torch.bool):
            raise ValueError(f"visibility: expected [{b}, {t}, {t}] bool, got {tuple(visibility.shape)}")
        if lengths is not None and lengths.shape != (b,):
            raise ValueError(f"lengths: expected shape ({b},), got {tuple(lengths.shape)}")
        bad = [i for i in capture_layers if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"capture_layers: {bad} outside 0..{self.config.num_hidden_layers - 1}")
        return b, t

    @staticmethod
    def _check_values(cache, t: int, lengths, logits_rows) -> None:
        """The checks that read tensor values (host syncs)."""
        if int(cache.seqlens.max()) + t > cache.max_len:
            raise ValueError(
                f"cache: seqlens + t = {int(cache.seqlens.max()) + t} exceeds max_len {cache.max_len}"
            )
        if lengths is not None and bool((lengths < 0).any() or (lengths > t).any()):
            raise ValueError(f"lengths: expected int64 in 0..{t}, got {lengths.tolist()}")
        if logits_rows is not None and bool((logits_rows < 0).any() or (logits_rows >= t).any()):
            raise ValueError(f"logits_rows: expected int64 in 0..{t - 1}, got {logits_rows.tolist()}")
