"""LatentKVCache: the MLA latent cache, contiguous per request."""

from __future__ import annotations

import torch

from kdtree_engine.impl import resolve_impl
from kdtree_engine.ref.cache_compact import compact_rows as ref_compact_rows


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
        # the most rows a request's own tokens fill (prompt + new tokens), where the owner knows it: the
        # rows past it are margins (a tree written and not kept); steers the attention's split count
        self.rows_hint: int | None = None

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
        copy = LatentKVCache(self.kv.clone(), self.seqlens.clone())
        copy.rows_hint = self.rows_hint
        return copy

    def compact(
        self,
        start: torch.Tensor,
        keep: torch.Tensor,
        keep_len: torch.Tensor,
        *,
        validate: bool = True,
        impl: str | None = None,
    ) -> None:
        """Keep only chosen rows after a verify forward, in every layer, in place.

        start [b] int64: seqlens before the verify forward; keep [b, k] int64: row indices relative to
        start (-1 padded, increasing within the kept part is not required); keep_len [b] int64.
        Row start[b] + keep[b, i] moves to start[b] + i for i < keep_len[b]; seqlens = start + keep_len.
        The k destination rows start[b] + 0..k-1 must lie in the cache (rows past keep_len are
        rewritten with their own value). validate=False skips the checks that read values, so the
        call never waits for the device (indices are then clamped into the cache). impl: "ref" (the torch
        reference, ref/cache_compact.py), a kernel impl (one launch, kernels/cache_compact.py) or None
        (the kernel on CUDA).
        """
        b, k = keep.shape
        if b != self.batch_size or start.shape != (b,) or keep_len.shape != (b,):
            raise ValueError(
                f"compact: expected start [{self.batch_size}], keep [{self.batch_size}, k], keep_len "
                f"[{self.batch_size}]; got {tuple(start.shape)}, {tuple(keep.shape)}, {tuple(keep_len.shape)}"
            )
        dev = self.kv.device
        start, keep, keep_len = start.to(dev), keep.to(dev), keep_len.to(dev)
        if validate:
            self._check_compact(start, keep, keep_len)
        if resolve_impl(impl, dev) == "ref":
            ref_compact_rows(self.kv, self.seqlens, start, keep, keep_len)
        else:
            from kdtree_engine.kernels.cache_compact import compact_rows

            compact_rows(self.kv, self.seqlens, start, keep, keep_len)

    def _check_compact(self, start, keep, keep_len) -> None:
        k = keep.shape[1]
        valid = torch.arange(k, device=keep.device)[None, :] < keep_len[:, None]  # [b, k]
        src = start[:, None] + keep.clamp(min=0)
        dst = start[:, None] + torch.arange(k, device=keep.device)[None, :]
        if bool((valid & (keep < 0)).any()):
            raise ValueError("keep: an index inside keep_len is -1")
        if bool((valid & (src >= self.max_len)).any()) or bool((dst >= self.max_len).any()):
            raise ValueError(f"keep: a row index is beyond max_len={self.max_len}")
