"""Reference of the cache compaction after a verify forward (kernels/cache_compact.py is its twin)."""

from __future__ import annotations

import torch


def compact_rows(kv: torch.Tensor, seqlens: torch.Tensor, start: torch.Tensor, keep: torch.Tensor,
                 keep_len: torch.Tensor) -> None:  # fmt: skip
    """In place, in every layer of kv [layers, b, max_len, d]: row start[b] + keep[b, i] moves to
    start[b] + i for i < keep_len[b] (every kept row gathered before any is written, so keep need not
    increase), indices clamped into the cache; rows past keep_len are left as they are; seqlens [b] =
    start + keep_len. start, keep_len [b] int64; keep [b, k] int64 (-1 padded past keep_len)."""
    b, k = keep.shape
    dev, max_len = kv.device, kv.shape[2]
    valid = torch.arange(k, device=dev)[None, :] < keep_len[:, None]  # [b, k]
    src = (start[:, None] + keep.clamp(min=0)).clamp(max=max_len - 1)
    dst = (start[:, None] + torch.arange(k, device=dev)[None, :]).clamp(max=max_len - 1)
    src = torch.where(valid, src, dst)  # rows past keep_len keep their value
    batch = torch.arange(b, device=dev)[:, None].expand(b, k)
    kv[:, batch, dst] = kv[:, batch, src]  # gathered before any write
    seqlens.copy_(start + keep_len)
