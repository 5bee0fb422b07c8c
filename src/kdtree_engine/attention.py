"""Public tree-verify MLA attention op (absorbed form, tree mask). See DESIGN.md section 2."""

from __future__ import annotations

import torch

from kdtree_engine.impl import resolve_impl
from kdtree_engine.ref import mla_attention as ref


def tree_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    d_v: int = 512,
    visibility: torch.Tensor | None = None,
    ancestor_bits: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of t tree (or new) tokens per request over its cached prefix plus the tree itself.

    q [b, t, h, d_v + d_r] absorbed queries (bf16 or float32); kv_cache [b, s_max, d_v + d_r]
    contiguous per request, or [pages, page_size, d_v + d_r] with block_table [b, max_pages] int32;
    cache_seqlens [b] int: slots in use, prefix + t (the tree is the last t slots);
    visibility [b, t, t] bool or ancestor_bits [b, t] int64 (t <= 64); neither means causal.
    Returns out [b, t, h, d_v] in q's dtype and lse [b, t, h] float32 (natural log).
    """
    b, t = q.shape[:2]
    if visibility is None:
        if ancestor_bits is not None:
            visibility = ref.bits_to_visibility(ancestor_bits, t)
        else:
            visibility = torch.ones(t, t, dtype=torch.bool, device=q.device).tril().expand(b, t, t)
    if resolve_impl(impl, q.device) == "triton":
        from kdtree_engine.kernels import mla_attention as kernels

        return kernels.tree_mla_attention(
            q, kv_cache, cache_seqlens, visibility, softmax_scale, d_v, block_table
        )
    out, lse = ref.tree_mla_attention(q, kv_cache, cache_seqlens, visibility, softmax_scale, d_v, block_table)
    return out.to(q.dtype), lse
