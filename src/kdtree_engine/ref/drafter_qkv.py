"""The DFlash drafter's per-head q/k RMSNorm, rotary embedding and context-cache write: the
specification of kernels/drafter_qkv.py (same signatures), plain torch with float32 math.

Input rows are fused projections `qkv` [..., h + 2g, d]: heads 0 .. h-1 the query, h .. h+g-1 the key,
h+g .. h+2g-1 the value. A query or key head is RMS-normed as model.mla.RMSNorm does it (float32
statistic, the normalized value rounded to the dtype, times the weight, rounded), then roped in
float32 with non-interleaved halves (Qwen3) at its row's position, cos / sin rounded to the dtype as
drafter.model.rope_cos_sin gives them, and rounded once. Values pass unchanged.

Dimension names: B batch, T block rows, C context rows, n layers, h query heads, g kv heads,
d head_dim, S cache slots (max_len + spare rows).
"""

from __future__ import annotations

import torch


def block_qkv(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    start: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, h + 2g, d] the block rows' projections (float32, bf16 or fp16); q_weight / k_weight
    [d] the q_norm / k_norm weights of qkv's dtype; start [B] int64: row t of request b has position
    start[b] + t; inv_freq [d / 2] float32; heads = h. Returns (q [B, T, h, d], k [B, T, g, d],
    v [B, T, g, d]) in qkv's dtype: q and k normed and roped, v as is. (The kernel writes q and k into
    qkv in place and returns views of it.)"""
    t = qkv.shape[1]
    g = (qkv.shape[2] - heads) // 2
    pos = start.to(qkv.device)[:, None] + torch.arange(t, device=qkv.device)  # [B, T]
    q = _norm_rope(qkv[:, :, :heads], q_weight, pos, inv_freq, eps)
    k = _norm_rope(qkv[:, :, heads : heads + g], k_weight, pos, inv_freq, eps)
    return q, k, qkv[:, :, heads + g :]


def context_kv_write(
    qkv: torch.Tensor,
    k_weight: torch.Tensor,
    seqlens: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    heads: int,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
) -> None:
    """qkv [B, C, n, h + 2g, d] the context rows' projections for n layers (the query heads are
    ignored); k_weight [n, d] the layers' k_norm weights; seqlens [B] int64: context row c of request b
    has position seqlens[b] + c and is written, normed and roped key and value, at slot
    min(seqlens[b] + c, S - 1) of layer l of cache_k / cache_v [n, B, S, g, d] (every row is written:
    the caller keeps padding rows past its lengths; rows clamped to the last slot overwrite each
    other there)."""
    b, c, n = qkv.shape[:3]
    g = (qkv.shape[3] - heads) // 2
    pos = seqlens.to(qkv.device)[:, None] + torch.arange(c, device=qkv.device)  # [B, C]
    k = _norm_rope(qkv[:, :, :, heads : heads + g], k_weight, pos[:, :, None], inv_freq, eps)
    v = qkv[:, :, :, heads + g :]
    slots = pos.clamp(max=cache_k.shape[2] - 1)
    rows = torch.arange(b, device=qkv.device)[:, None]
    for layer in range(n):
        cache_k[layer, rows, slots] = k[:, :, layer].to(cache_k.dtype)
        cache_v[layer, rows, slots] = v[:, :, layer].to(cache_v.dtype)


def _norm_rope(
    x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [..., heads, d]; weight [d] or [layers, d] (matching x's dimension before heads); pos [...]
    int64, the leading dims of x (broadcastable) -> [..., heads, d] in x's dtype."""
    dtype, half = x.dtype, x.shape[-1] // 2
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()
    y = (weight.float()[..., None, :] * y).to(dtype).float()
    angles = pos[..., None].float() * inv_freq.float().to(x.device)  # [..., d / 2]
    cos = angles.cos().to(dtype).float()[..., None, :]
    sin = angles.sin().to(dtype).float()[..., None, :]
    y1, y2 = y[..., :half], y[..., half:]
    return torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1).to(dtype)
