"""LatentKVCache: the MLA latent cache, contiguous per request."""

from __future__ import annotations

import torch


class LatentKVCache:
    """kv [num_layers, b, max_len, kv_lora_rank + qk_rope_head_dim]: per token and layer the normalized
    c_kv then the roped k_pe; seqlens [b] int64: rows in use per request (the same in every layer)."""

    def __init__(self, kv: torch.Tensor, seqlens: torch.Tensor | None = None) -> None:
        if kv.dim() != 4:
            raise ValueError(f"kv: expected [num_layers, b, max_len, d], got shape {tuple(kv.shape)}")
        if seqlens is None:
            seqlens = torch.zeros(kv.shape[1], dtype=torch.int64, device=kv.device)
        if seqlens.shape != (kv.shape[1],):
            raise ValueError(f"seqlens: expected shape ({kv.shape[1]},), got {tuple(seqlens.shape)}")
        self.kv = kv
        self.seqlens = seqlens.to(device=kv.device, dtype=torch.int64)

    @classmethod
    def empty(
        cls, num_layers: int, batch_size: int, max_len: int, dim: int, *, dtype: torch.dtype, device
    ) -> LatentKVCache:
        """A cache with every row NaN (float dtypes), so that reading an unwritten row shows up."""
        kv = torch.full((num_layers, batch_size, max_len, dim), float("nan"), dtype=dtype, device=device)
        return cls(kv)

    @property
    def batch_size(self) -> int:
        return int(self.kv.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.kv.shape[2])

    def clone(self) -> LatentKVCache:
        return LatentKVCache(self.kv.clone(), self.seqlens.clone())

    def compact(self, start: torch.Tensor, keep: torch.Tensor, keep_len: torch.Tensor) -> None:
        """Keep only chosen rows after a verify forward, in every layer.

        start [b] int64: seqlens before the verify forward; keep [b, k] int64: row indices relative to
        start (-1 padded, increasing within the kept part is not required); keep_len [b] int64.
        Row start[b] + keep[b, i] moves to start[b] + i for i < keep_len[b]; seqlens = start + keep_len.
        """
        b, k = keep.shape
        if b != self.batch_size or start.shape != (b,) or keep_len.shape != (b,):
            raise ValueError(
                f"compact: expected start [{self.batch_size}], keep [{self.batch_size}, k], keep_len "
                f"[{self.batch_size}]; got {tuple(start.shape)}, {tuple(keep.shape)}, {tuple(keep_len.shape)}"
            )
        dev = self.kv.device
        start, keep, keep_len = start.to(dev), keep.to(dev), keep_len.to(dev)
        valid = torch.arange(k, device=dev)[None, :] < keep_len[:, None]  # [b, k]
        if bool((valid & (keep < 0)).any()):
            raise ValueError("keep: an index inside keep_len is -1")
        src = start[:, None] + keep.clamp(min=0)  # [b, k]
        dst = start[:, None] + torch.arange(k, device=dev)[None, :]
        if bool((valid & ((src >= self.max_len) | (dst >= self.max_len))).any()):
            raise ValueError(f"keep: a row index is beyond max_len={self.max_len}")
        src, dst = src.clamp(max=self.max_len - 1), dst.clamp(max=self.max_len - 1)
        batch = torch.arange(b, device=dev)[:, None].expand(b, k)
        rows = self.kv[:, batch, src]  # [layers, b, k, d], gathered before any write
        self.kv[:, batch[valid], dst[valid]] = rows[:, valid]
        self.seqlens = start.to(torch.int64) + keep_len.to(torch.int64)
