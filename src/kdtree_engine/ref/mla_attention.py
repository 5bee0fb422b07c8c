"""Reference tree-verify MLA attention, absorbed form (docs/attention.md). torch float32, CPU or GPU.

Per request b with `cache_seqlens[b]` slots in use, the last t slots hold the tree (or the new tokens
of a decode / prefill step) and the slots before them the prefix. Query i attends to every prefix slot
and to tree slot j iff visible[b, i, j]. The value is the first d_v (latent) dims of the same row.
"""

from __future__ import annotations

import torch


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor | None, b: int, length: int) -> torch.Tensor:
    """Rows 0..length-1 of request b: [length, d]. kv_cache is [b, s_max, d] or paged [pages, page, d]."""
    if block_table is None:
        return kv_cache[b, :length]
    page = kv_cache.shape[1]
    slots = torch.arange(length, device=kv_cache.device)
    pages = block_table[b, slots // page].long()
    return kv_cache[pages, slots % page]


def bits_to_visibility(ancestor_bits: torch.Tensor, t: int) -> torch.Tensor:
    """ancestor_bits [b, t] int64 -> visibility [b, t, t] bool (bit j of row i)."""
    j = torch.arange(t, device=ancestor_bits.device)
    return ((ancestor_bits.unsqueeze(-1) >> j) & 1).bool()


def tree_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    visibility: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, t, h, d], kv_cache [b, s_max, d] or [pages, page_size, d], cache_seqlens [b] (prefix + t),
    visibility [b, t, t] bool -> out [b, t, h, d_v], lse [b, t, h] (natural log), both float32, or
    float64 for float64 inputs."""
    b, t, h, _ = q.shape
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(b, t, h, d_v, dtype=dtype)
    lse = q.new_empty(b, t, h, dtype=dtype)
    for r in range(b):
        length = int(cache_seqlens[r])
        kv = gather_kv(kv_cache, block_table, r, length).to(dtype)  # [s, d]
        scores = torch.einsum("thd,sd->ths", q[r].to(dtype), kv) * softmax_scale  # [t, h, s]
        allowed = torch.ones(t, length, dtype=torch.bool, device=q.device)
        allowed[:, length - t :] = visibility[r]
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        lse[r] = torch.logsumexp(scores, dim=-1)
        out[r] = torch.einsum("ths,sd->thd", torch.softmax(scores, dim=-1), kv[:, :d_v])
    return out, lse
