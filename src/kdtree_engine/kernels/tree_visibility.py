"""Ancestor-or-self visibility of a batch of trees from their parent arrays, on the GPU.

`ancestor_rows` is the row computation, shared with the compile kernel: row i marks i, then walks its
parent chain L times (a node's depth is at most L), marking every ancestor. `write_visibility` writes
whole [N, N] matrices into a caller's bool buffer (SGLang's layout: rows of unused nodes all False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit
def ancestor_rows(par_row, rows, real, cols, L: tl.constexpr):
    """[RB, NP] bool: row r marks rows[r] and, where real[r], its ancestors read from par_row."""
    cur = tl.load(par_row + rows, mask=real, other=-1)
    vis = rows[:, None] == cols[None, :]
    for _ in range(L):
        vis = vis | (cur[:, None] == cols[None, :])
        cur = tl.load(par_row + cur, mask=cur >= 0, other=-1)
    return vis


@triton.jit
def _visibility_kernel(
    par_ptr,  # [B, >= N] int64, parents[:, 0] = -1
    size_ptr,  # [B] int64: real nodes, root included
    vis_ptr,  # [B, >= N, >= N] int8 (a bool buffer viewed as int8), strided
    N,
    par_stride,
    vis_sb,
    vis_sr,
    vis_sc,
    L: tl.constexpr,
    RB: tl.constexpr,
    NP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)
    cols = tl.arange(0, NP)
    real = rows < tl.load(size_ptr + b)
    vis = ancestor_rows(par_ptr + b * par_stride, rows, real, cols, L) & real[:, None]
    out = vis_ptr + b * vis_sb + rows[:, None] * vis_sr + cols[None, :] * vis_sc
    tl.store(out, vis.to(tl.int8), mask=(rows[:, None] < N) & (cols[None, :] < N))


def write_visibility(parents: torch.Tensor, sizes: torch.Tensor, out: torch.Tensor, depth_limit: int) -> None:
    """parents [B, >= N] int64 (unit column stride), sizes [B] int64 (real nodes with the root) ->
    out[:B, :N, :N] (a bool tensor, any strides): out[b, i, j] = node j is node i or an ancestor of it,
    for i < sizes[b]; False elsewhere. N = out.shape[1]; depth_limit bounds every node's depth."""
    b, n = out.shape[0], out.shape[1]
    if b == 0 or n == 0:
        return
    view = out.view(torch.int8)
    np2 = triton.next_power_of_2(n)
    rb = max(1, min(np2, 4096 // np2))
    _visibility_kernel[(b, triton.cdiv(n, rb))](
        parents,
        sizes,
        view,
        n,
        parents.stride(0),
        *view.stride(),
        L=depth_limit,
        RB=rb,
        NP=np2,
        num_warps=4,
        **pdl.launch(parents.device),
    )
