"""The cache compaction after a verify forward in one launch: twin of ref/cache_compact.py (about a dozen
small torch kernels: index arithmetic, an advanced-index gather and scatter, the lengths).

One program per (request, layer, block of latent columns) loads every kept row of its block (the rows
start + keep[i], i < keep_len, indices clamped into the cache) into registers, then stores them at
start + i: all of a program's reads come before its writes, and programs touch disjoint columns, so any
order of keep is moved correctly, as the reference's gather-then-scatter does. Rows past keep_len are
not touched (the reference rewrites them with their own value). The first program of each request
writes its length, start + keep_len. An exact copy: the cache's dtype in and out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit
def _compact_kernel(
    kv_ptr,  # [layers, b, max_len, d]
    seqlens_ptr,  # [b] int64, written
    start_ptr,  # [b] int64
    keep_ptr,  # [b, k] int64, -1 padded
    keep_len_ptr,  # [b] int64
    k,
    d,
    max_len,
    kv_sl,
    kv_sb,
    kv_sr,
    keep_sb,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0)
    layer = tl.program_id(1)
    block = tl.program_id(2)
    start = tl.load(start_ptr + b)
    count = tl.load(keep_len_ptr + b)
    rows = tl.arange(0, BLOCK_K)
    valid = (rows < count) & (rows < k)
    keep = tl.load(keep_ptr + b * keep_sb + rows, mask=valid, other=0)
    src = tl.minimum(start + tl.maximum(keep, 0), max_len - 1)
    dst = tl.minimum(start + rows, max_len - 1)
    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (cols < d)[None, :]
    base = kv_ptr + layer * kv_sl + b * kv_sb
    tile = tl.load(base + src[:, None] * kv_sr + cols[None, :], mask=mask)
    tl.store(base + dst[:, None] * kv_sr + cols[None, :], tile, mask=mask)
    if (layer == 0) & (block == 0):
        tl.store(seqlens_ptr + b, start + count)


def compact_rows(kv: torch.Tensor, seqlens: torch.Tensor, start: torch.Tensor, keep: torch.Tensor,
                 keep_len: torch.Tensor) -> None:  # fmt: skip
    """ref.cache_compact.compact_rows in one launch (the same arguments; kv's rows contiguous)."""
    layers, b, max_len, d = kv.shape
    k = keep.shape[1]
    if b == 0 or k == 0:
        seqlens.copy_(start + keep_len)
        return
    if kv.stride(3) != 1:
        raise ValueError("kv: the compaction kernel needs contiguous latent rows (stride 1 in the last dim)")
    keep = keep.contiguous()
    block_k = max(triton.next_power_of_2(k), 16)
    block_d = min(triton.next_power_of_2(d), 64)
    grid = (b, layers, triton.cdiv(d, block_d))
    _compact_kernel[grid](
        kv, seqlens, start.contiguous(), keep, keep_len.contiguous(), k, d, max_len,
        kv.stride(0), kv.stride(1), kv.stride(2), keep.stride(0),
        BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4,
        **pdl.launch(kv.device),
    )  # fmt: skip
