"""What every tree-verify MLA attention kernel launch shares: the problem's sizes and its per-forward
tensors (lengths, mask, block table), fixed once per forward by the attention plan and the same in
every layer. Kernels assume these were validated at the public boundary (kdtree_engine.attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634
MASK_VISIBILITY, MASK_BITS, MASK_CAUSAL = 0, 1, 2


@dataclass(frozen=True)
class Mask:
    """The tree mask as the kernels read it: mode MASK_VISIBILITY (tensor [b, t, t] uint8), MASK_BITS
    (tensor [b, t] int64, bit j of row i) or MASK_CAUSAL (tensor unused: any int tensor)."""

    mode: int
    tensor: torch.Tensor
    stride_b: int
    stride_i: int

    @classmethod
    def make(cls, visibility: torch.Tensor | None, ancestor_bits: torch.Tensor | None, dummy: torch.Tensor):
        if ancestor_bits is not None:
            return cls(MASK_BITS, ancestor_bits, ancestor_bits.stride(0), 0)
        if visibility is None:
            return cls(MASK_CAUSAL, dummy, 0, 0)
        vis = visibility.contiguous().view(torch.uint8)
        return cls(MASK_VISIBILITY, vis, vis.stride(0), vis.stride(1))


@dataclass(frozen=True)
class Problem:
    """One forward's attention problem, as every layer sees it.

    q [b, t, h, d] and the cache [b, s_max, d] (or [pages, page_size, d] with block_table [b, pages]);
    rows = t * h query rows per request (row = node * h + head); d_v latent columns (d - d_v rope ones);
    seqlens [b] int: cache slots in use, the tree being the last t."""

    b: int
    t: int
    h: int
    d: int
    d_v: int
    softmax_scale: float
    seqlens: torch.Tensor
    mask: Mask
    block_table: torch.Tensor | None

    @property
    def qk_scale(self) -> float:
        """The kernels' score scale: softmax scale * log2(e) (they exponentiate with exp2)."""
        return self.softmax_scale * LOG2E

    @property
    def rows(self) -> int:
        return self.t * self.h

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def table(self) -> torch.Tensor:
        """The block table, or a stand-in pointer for a contiguous cache (never read then)."""
        return self.block_table if self.block_table is not None else self.seqlens


@dataclass(frozen=True)
class LaunchBounds:
    """What a forward's plan knows of the lengths and asks of the split, as every kernel module's
    `plan_launch` reads it (each takes what it uses)."""

    max_seqlen: int | None  # a bound on the lengths the launch may trust (None: unknown, a captured forward)
    steer: int  # the longest length expected: steers the Triton kernel's split count, not trusted as a bound
    num_splits: int  # 0: the kernel's own schedule; else each row block's KV range in that many pieces
    invariant: bool  # the Triton kernel's row-invariant mode
