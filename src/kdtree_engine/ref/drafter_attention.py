"""Attention of a DFlash drafter block over its context cache: the specification of
kernels/drafter_attention.py (same signature), in plain torch with float32 math.

Every block row attends to the request's context rows (cache slots 0 .. new_len[b] - 1) and to all T
rows of its own block (bidirectional); query head i reads kv head i // (h // g) (GQA, as
`repeat_interleave`). Cache slots at or past new_len[b] may hold anything, NaN included: they are never
part of the result.

Dimension names: B batch, T block rows, h query heads, g kv heads (h % g == 0), d head_dim,
S cache slots (max_len + spare rows).
"""

from __future__ import annotations

import math

import torch


def drafter_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    new_len: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
) -> torch.Tensor:
    """q [B, T, h, d] the block's queries; cache_k / cache_v [B, S, g, d] this layer's context cache,
    slots < new_len[b] read; new_len [B] int64 (0 .. S); k_blk / v_blk [B, T, g, d] the block's own keys
    and values. All of q's dtype (float32, bf16 or fp16). Returns out [B, T, h, d] in q's dtype:
    softmax(q k^T / sqrt(d)) v over [context rows | block rows], computed in float32."""
    b, t, h, d = q.shape
    g, s = k_blk.shape[2], cache_k.shape[1]
    valid = torch.arange(s, device=q.device)[None, :] < new_len.to(q.device)[:, None]  # [B, S]
    k = torch.cat([_rows(cache_k, valid), k_blk.float()], dim=1)  # [B, S + T, g, d]
    v = torch.cat([_rows(cache_v, valid), v_blk.float()], dim=1)
    keep = torch.cat([valid, valid.new_ones(b, t)], dim=1)  # [B, S + T]
    qg = q.float().view(b, t, g, h // g, d)
    scores = torch.einsum("btgrd,bsgd->bgrts", qg, k) / math.sqrt(d)  # [B, g, h/g, T, S + T]
    scores = scores.masked_fill(~keep[:, None, None, None, :], float("-inf"))
    out = torch.einsum("bgrts,bsgd->btgrd", scores.softmax(dim=-1), v)  # [B, T, g, h/g, d]
    return out.reshape(b, t, h, d).to(q.dtype)


def _rows(cache: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cache [B, S, g, d] -> float32 copy with the unread slots zeroed (NaN there must not leak into
    0 * NaN in the products)."""
    return torch.where(valid[:, :, None, None], cache.float(), 0.0)
