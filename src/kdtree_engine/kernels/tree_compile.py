"""Compile a batch of draft trees for verify on the GPU (twin of ref.tree.compile_tree).

Grid (B, row blocks): each program owns RB node rows of one request and every column. A row's
ancestors are found by walking the parent chain L times (tree_visibility.ancestor_rows); first child
and next sibling are column minima of `parents[j] == i` and `parents[j] == parents[i], j > i`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.kernels.tree_visibility import ancestor_rows
from kdtree_engine.tree_types import DraftTree, VerifyInputs


@triton.jit
def _compile_kernel(
    tok_ptr,  # [B, N - 1] int64
    dep_ptr,  # [B, N - 1] int64
    par_ptr,  # [B, N] int64
    cnt_ptr,  # [B] int64
    root_ptr,  # [B] int64
    start_ptr,  # [B] int64
    ids_out,  # [B, N] int64
    pos_out,  # [B, N] int64
    vis_out,  # [B, N, N] int8 (viewed as bool)
    bits_out,  # [B, N] int64, written when WITH_BITS
    ridx_out,  # [B, N] int64
    rnext_out,  # [B, N] int64
    rsib_out,  # [B, N] int64
    N,
    L: tl.constexpr,
    WITH_BITS: tl.constexpr,
    RB: tl.constexpr,
    NP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)  # node i
    cols = tl.arange(0, NP)  # node j
    used = tl.load(cnt_ptr + b) + 1
    real = rows < used
    row_ok = rows < N
    par_row = par_ptr + b * N

    par_rows = tl.load(par_row + rows, mask=real, other=-1)  # [RB]
    vis = ancestor_rows(par_row, rows, real, cols, L)  # [RB, NP]; unused rows see themselves
    out2 = b * N * N + rows[:, None] * N + cols[None, :]
    tl.store(vis_out + out2, vis.to(tl.int8), mask=row_ok[:, None] & (cols[None, :] < N))
    if WITH_BITS:
        bits = tl.sum(tl.where(vis, tl.full([NP], 1, tl.int64) << cols.to(tl.int64), 0), axis=1)
        tl.store(bits_out + b * N + rows, bits, mask=row_ok)

    col_real = (cols >= 1) & (cols < used)
    par_cols = tl.load(par_row + cols, mask=col_real, other=-2)  # [NP]
    none = NP + 1
    child = par_cols[None, :] == rows[:, None]
    first_child = tl.min(tl.where(child, cols[None, :], none), axis=1)
    sib = (par_cols[None, :] == par_rows[:, None]) & (cols[None, :] > rows[:, None])
    sib = sib & ((rows >= 1) & real)[:, None]
    next_sib = tl.min(tl.where(sib, cols[None, :], none), axis=1)
    tl.store(rnext_out + b * N + rows, tl.where(first_child == none, -1, first_child), mask=row_ok)
    tl.store(rsib_out + b * N + rows, tl.where(next_sib == none, -1, next_sib), mask=row_ok)

    node = (rows >= 1) & real
    tok = tl.load(tok_ptr + b * (N - 1) + rows - 1, mask=node, other=0)
    dep = tl.load(dep_ptr + b * (N - 1) + rows - 1, mask=node, other=0)
    root = tl.load(root_ptr + b)
    tl.store(ids_out + b * N + rows, tl.where(rows == 0, root, tok), mask=row_ok)
    tl.store(pos_out + b * N + rows, tl.load(start_ptr + b) + dep, mask=row_ok)
    tl.store(ridx_out + b * N + rows, tl.where(real, b * N + rows, -1), mask=row_ok)


def compile_tree(tree: DraftTree, root_tokens: torch.Tensor, start_positions: torch.Tensor) -> VerifyInputs:
    """root_tokens [B] int64, start_positions [B] int64 (validated) -> VerifyInputs, equal to the ref's."""
    b, n = tree.batch_size, tree.budget + 1
    dev = tree.device
    i64 = dict(dtype=torch.int64, device=dev)
    out = {k: torch.empty((b, n), **i64) for k in ("ids", "pos", "ridx", "rnext", "rsib")}
    vis = torch.empty((b, n, n), dtype=torch.int8, device=dev)
    bits = torch.empty((b, n), **i64) if n <= 64 else None
    if b:
        np2 = triton.next_power_of_2(n)
        rb = max(1, min(np2, 4096 // np2))
        _compile_kernel[(b, triton.cdiv(n, rb))](
            tree.tokens.contiguous(),
            tree.depths.contiguous(),
            tree.parents.contiguous(),
            tree.num_nodes.contiguous(),
            root_tokens,
            start_positions,
            out["ids"],
            out["pos"],
            vis,
            bits if bits is not None else out["ids"],
            out["ridx"],
            out["rnext"],
            out["rsib"],
            n,
            L=tree.max_depth,
            WITH_BITS=bits is not None,
            RB=rb,
            NP=np2,
            num_warps=4,
            **pdl.launch(tree.tokens.device),
        )
    return VerifyInputs(
        input_ids=out["ids"],
        positions=out["pos"],
        visibility=vis.view(torch.bool),
        ancestor_bits=bits,
        retrieve_index=out["ridx"],
        retrieve_next_token=out["rnext"],
        retrieve_next_sibling=out["rsib"],
    )
