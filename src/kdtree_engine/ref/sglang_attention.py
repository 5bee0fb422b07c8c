"""The forward metadata of the `kdtree_mla` SGLang attention backend (integrations/sglang/attention.py),
in plain torch: the specification of kernels/sglang_attention.py.

From SGLang's per-forward inputs (seq_lens, req_pool_indices, the req_to_token table, the verify input's
tree) it derives what our attention op reads for every layer:
- seqlens [bs] int32: cache slots per request, the forward's t new tokens included;
- block_table [bs, cols] int32: page p of request r is req_to_token[req_pool_indices[r], p * page] //
  page (SGLang's paged allocator hands out page-aligned rows; page 1 is the rows themselves);
- ancestor bits [bs, t] int64 (t <= 64): bit j of row i is visibility[r, i, j]; requests past the
  visibility's batch (padding of a replayed CUDA graph) see only themselves.
"""

from __future__ import annotations

import torch

MAX_BITS = 64  # trees up to this many nodes become ancestor bits (bit 63 is the sign bit)


def seqlens_with_new(seq_lens: torch.Tensor, t: int) -> torch.Tensor:
    """[bs] int32: seq_lens + t."""
    return (seq_lens + t).to(torch.int32)


def block_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page: int, cols: int
) -> torch.Tensor:
    """[bs, cols] int32 page ids of the batch's requests (cols <= ceil(req_to_token width / page))."""
    rows = req_to_token[req_pool_indices.long()][:, ::page][:, :cols]
    return (rows // page).to(torch.int32)


def padded_visibility(visibility: torch.Tensor, bs: int, t: int) -> torch.Tensor:
    """[bs, t, t] bool from visibility [>= 0, >= t, >= t]: its first bs requests, then requests that see
    only themselves."""
    vis = visibility[:bs, :t, :t].to(torch.bool)
    if vis.shape[0] == bs:
        return vis
    pad = torch.eye(t, dtype=torch.bool, device=vis.device).expand(bs - vis.shape[0], t, t)
    return torch.cat([vis, pad])


def visibility_to_bits(vis: torch.Tensor) -> torch.Tensor:
    """[b, t, t] bool -> [b, t] int64, bit j of row i = vis[i, j] (t <= 64)."""
    t = vis.shape[-1]
    weights = torch.ones(t, dtype=torch.int64, device=vis.device) << torch.arange(t, device=vis.device)
    return (vis.long() * weights).sum(-1)


def verify_metadata(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    visibility: torch.Tensor | None,
    t: int,
    page: int,
    cols: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(seqlens, block_table, bits) of one forward of t new tokens per request; bits only for a tree
    (visibility given) of t <= MAX_BITS nodes, else None."""
    bs = seq_lens.shape[0]
    seqlens = seqlens_with_new(seq_lens, t)
    table = block_table(req_to_token, req_pool_indices, page, cols)
    bits = None
    if visibility is not None and t <= MAX_BITS:
        bits = visibility_to_bits(padded_visibility(visibility, bs, t))
    return seqlens, table, bits
