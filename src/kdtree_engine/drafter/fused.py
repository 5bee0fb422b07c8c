"""The DFlash drafter's forward through the Triton kernels: the same function as the reference forward
(DFlashDrafter with impl="ref"), in few launches, the cache read in place.

Per forward: fc GEMM, hidden_norm, ONE GEMM for the q/k/v projections of the context rows of every
layer (the context rows are the same input to every layer: the official layer norms only the block),
and one launch that norms, ropes and writes those keys and values into every layer's cache. Per layer
nine launches: input RMSNorm, the block's fused q/k/v GEMM, q/k RMSNorm + rope in place, attention over
[cache slots < new_len | block rows] (kernels/drafter_attention.py), o_proj GEMM accumulating into the
residual stream (beta = 1, in place), post-attention RMSNorm, fused gate/up GEMM, SiLU * up, down_proj
GEMM accumulating into the residual stream.

Dimension names: B batch, C new context rows, T = block_size, n layers, H hidden, F = len(target
layers) * H, h heads, g kv heads, d head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdtree_engine.drafter.packed import PackedWeights, packed_weights
from kdtree_engine.kernels.drafter_attention import drafter_attention
from kdtree_engine.kernels.drafter_mlp import silu_mul
from kdtree_engine.kernels.drafter_qkv import block_qkv, context_kv_write
from kdtree_engine.kernels.rmsnorm import rmsnorm

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_forward(drafter, x: torch.Tensor, context, context_lens, start, cache) -> torch.Tensor:
    """x [B, T, H] contiguous block embeddings in the drafter's dtype: OVERWRITTEN (it becomes the
    residual stream). context [B, C, F], context_lens [B] int64, start [B] int64, cache: a DrafterCache,
    as DFlashDrafter.forward. Returns the final-normed hidden states [B, T, H]; cache.seqlens advanced.
    No host reads."""
    b, t, hid = x.shape
    w = packed_weights(drafter)
    inv_freq = drafter.rope_inv_freq(x.device)
    new_len = cache.seqlens + context_lens  # [B]
    if context.shape[1]:
        _write_context(drafter, w, context, cache, inv_freq)
    rows = x.view(b * t, hid)
    for i, layer in enumerate(drafter.layers):
        _layer(layer, w, i, rows, (b, t), cache.k[i], cache.v[i], new_len, start, inv_freq)
    cache.seqlens.copy_(new_len)
    return rmsnorm(rows, drafter.norm.weight, drafter.norm.eps).view(b, t, hid)


def _write_context(drafter, w: PackedWeights, context: torch.Tensor, cache, inv_freq: torch.Tensor) -> None:
    """context [B, C, F] -> hidden_norm(fc(.)) [B * C, H] -> k, v of every layer, written at slots
    seqlens[b] + c (clamped into the spare rows) of the cache. Four launches."""
    b, c, _ = context.shape
    attn, n = drafter.layers[0].self_attn, len(drafter.layers)
    dtype = drafter.fc.weight.dtype
    ctx = F.linear(context.to(dtype).reshape(b * c, -1), drafter.fc.weight)  # [B * C, H]
    ctx = rmsnorm(ctx, drafter.hidden_norm.weight, drafter.hidden_norm.eps)
    bias = w.qkv_bias.flatten() if w.qkv_bias is not None else None
    qkv = F.linear(ctx, w.qkv.flatten(0, 1), bias)  # [B * C, n * (h + 2g) * d]
    heads = attn.heads + 2 * attn.kv_heads
    qkv = qkv.view(b, c, n, heads, attn.head_dim)
    eps = attn.k_norm.eps
    context_kv_write(qkv, w.k_norm, cache.seqlens, inv_freq, eps, attn.heads, cache.k, cache.v)


def _layer(layer, w: PackedWeights, i: int, x: torch.Tensor, bt: tuple[int, int], cache_k, cache_v,
           new_len, start, inv_freq) -> None:  # fmt: skip
    """One DFlashLayer on the residual stream x [B * T, H], updated in place; cache_k / cache_v
    [B, max_len + spare, g, d] this layer's (context rows already written)."""
    attn, mlp = layer.self_attn, layer.mlp
    b, t = bt
    hidden = rmsnorm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    bias = w.qkv_bias[i] if w.qkv_bias is not None else None
    qkv = F.linear(hidden, w.qkv[i], bias).view(b, t, -1, attn.head_dim)  # [B, T, h + 2g, d]
    q, k, v = block_qkv(qkv, w.q_norm[i], w.k_norm[i], start, inv_freq, attn.q_norm.eps, attn.heads)
    out = drafter_attention(q, cache_k, cache_v, new_len, k, v)  # [B, T, h, d]
    _add_linear(x, out.view(b * t, -1), attn.o_proj)
    hidden = rmsnorm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    gate_up = F.linear(hidden, w.gate_up[i])  # [B * T, 2I]
    _add_linear(x, silu_mul(gate_up), mlp.down_proj)


def _add_linear(x: torch.Tensor, a: torch.Tensor, linear: torch.nn.Linear) -> None:
    """x += linear(a) in place: one GEMM with beta = 1 (a bias, if any, is one more launch)."""
    x.addmm_(a, linear.weight.t())
    if linear.bias is not None:
        x.add_(linear.bias)
