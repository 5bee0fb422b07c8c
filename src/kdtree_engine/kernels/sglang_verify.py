"""The verify-side tree ops of the SGLang port's layout on the GPU, twins of ref.sglang_verify: the
verify inputs (its verify_inputs, pad_visibility_ and packed_tree_mask) and the greedy accepted path
(its follow_verified_path: the shared greedy walk of kernels/tree_accept.py with the port's rules).

The verify inputs take two launches, both free of host reads:
- `write_verify_inputs`: grid (B,). Program b writes slot j of request b (root token / start position
  at j = 0, node j's draft token / start + depth after) and, when asked, turns the visibility rows of
  b's padding slots into self-only rows, in tiles of RB rows.
- `write_packed_mask`: grid (B * q, kv blocks). Program (row, k) writes BK columns of one query row of
  the request-packed allow-mask; each request's start in the packed buffer comes from a device cumsum
  of the past lengths, so no loop over the other requests is needed.
Bool tensors are read and written through int8 views of the same memory; all strides are honoured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.kernels.tree_accept import walk


@triton.jit
def _verify_inputs_kernel(
    root_ptr,  # [B] root tokens
    tok_ptr,  # [B, >= q - 1] draft tokens of nodes 1.., strided
    dep_ptr,  # [B, >= q - 1] depths of nodes 1.., strided
    start_ptr,  # [B] position of the root
    size_ptr,  # [B] real slots (root included)
    vis_ptr,  # [B, >= q, >= q] visibility as int8, strided; written when PAD
    ids_out,  # [B, q] contiguous
    pos_out,  # [B, q] contiguous
    q,
    tok_sb,
    tok_sc,
    dep_sb,
    dep_sc,
    vis_sb,
    vis_sr,
    vis_sc,
    PAD: tl.constexpr,
    QP: tl.constexpr,
    RB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, QP)
    in_row = slot < q
    is_node = in_row & (slot >= 1)
    node_col = (slot - 1).to(tl.int64)

    # Slot 0 carries the root; slot j >= 1 reads column j - 1 of the node buffers.
    tok = tl.load(tok_ptr + b * tok_sb + node_col * tok_sc, mask=is_node, other=0).to(tl.int64)
    dep = tl.load(dep_ptr + b * dep_sb + node_col * dep_sc, mask=is_node, other=0).to(tl.int64)
    root = tl.load(root_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)
    tl.store(ids_out + b * q + slot, tl.where(slot == 0, root, tok), mask=in_row)
    tl.store(pos_out + b * q + slot, start + dep, mask=in_row)  # dep is 0 at the root

    if PAD:
        # Rows size..q-1 become self-only; the row tiles below `size` store nothing.
        size = tl.load(size_ptr + b)
        cols = tl.arange(0, QP)
        base = vis_ptr + b * vis_sb
        for r0 in range(0, q, RB):
            rows = r0 + tl.arange(0, RB)
            pad_row = (rows >= size) & (rows < q)
            keep = pad_row[:, None] & (cols[None, :] < q)
            dst = base + rows[:, None].to(tl.int64) * vis_sr + cols[None, :].to(tl.int64) * vis_sc
            tl.store(dst, (rows[:, None] == cols[None, :]).to(tl.int8), mask=keep)


@triton.jit
def _packed_mask_kernel(
    vis_ptr,  # [B, >= q, >= q] visibility as int8, strided
    size_ptr,  # [B] real slots (root included)
    past_ptr,  # [B] committed prefix lengths
    cum_ptr,  # [B] inclusive cumsum of the past lengths (int64)
    mask_out,  # packed allow-mask as int8
    q,
    vis_sb,
    vis_sr,
    vis_sc,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row_id = tl.program_id(0).to(tl.int64)
    b = row_id // q
    row = row_id - b * q
    past = tl.load(past_ptr + b).to(tl.int64)
    size = tl.load(size_ptr + b).to(tl.int64)
    kv = past + q
    # Request b starts after the [q, past_r + q] blocks of every request r < b.
    start = q * (tl.load(cum_ptr + b) - past) + b * q * q

    col = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
    in_kv = col < kv
    slot = col - past  # the tree slot a column stands for (negative inside the prefix)
    real_row = row < size
    real_slot = (slot >= 0) & (slot < size)
    vis = tl.load(
        vis_ptr + b * vis_sb + row * vis_sr + slot * vis_sc, mask=in_kv & real_row & real_slot, other=0
    )
    allow_real = (col < past) | (real_slot & (vis != 0))
    allow = tl.where(real_row, allow_real, slot == row)  # a padding row sees only itself
    tl.store(mask_out + start + row * kv + col, allow.to(tl.int8), mask=in_kv)


def write_verify_inputs(
    root_token_ids: torch.Tensor,
    node_token_ids: torch.Tensor,
    node_depths: torch.Tensor,
    start_positions: torch.Tensor,
    sizes: torch.Tensor,
    visibility: torch.Tensor,
    ids_out: torch.Tensor,
    pos_out: torch.Tensor,
    pad_visibility: bool,
) -> None:
    """Fills ids_out / pos_out ([B, q] contiguous, B = ids_out.shape[0]) from the root and node buffers
    ([>= B], [>= B, >= q - 1] any strides); with pad_visibility, rows sizes[b]..q-1 of visibility[b, :q,
    :q] ([>= B, >= q, >= q] bool, any strides) become self-only. Inputs are validated by the caller."""
    b, q = ids_out.shape
    if b == 0 or q == 0:
        return
    qp = triton.next_power_of_2(q)
    vis = visibility.view(torch.int8)
    _verify_inputs_kernel[(b,)](
        root_token_ids,
        node_token_ids,
        node_depths,
        start_positions,
        sizes,
        vis,
        ids_out,
        pos_out,
        q,
        *node_token_ids.stride(),
        *node_depths.stride(),
        *vis.stride(),
        PAD=bool(pad_visibility),
        QP=qp,
        RB=max(1, min(qp, 4096 // qp)),
        num_warps=4 if qp >= 256 else 1,
        **pdl.launch(root_token_ids.device),
    )


def write_packed_mask(
    visibility: torch.Tensor,
    sizes: torch.Tensor,
    past_lengths: torch.Tensor,
    q: int,
    max_kv_len: int,
    mask_out: torch.Tensor,
) -> None:
    """Writes the packed allow-mask of sizes.shape[0] requests into mask_out (1-D bool holding exactly
    q * sum(past_b + q) elements). max_kv_len bounds past_b + q (it sizes the grid); past_lengths and
    sizes [B] live on the device and are not read back."""
    b = sizes.shape[0]
    if b == 0 or q == 0 or max_kv_len <= 0:
        return
    cum = torch.cumsum(past_lengths, dim=0, dtype=torch.int64)
    bk = min(1024, triton.next_power_of_2(max_kv_len))
    vis = visibility.view(torch.int8)
    _packed_mask_kernel[(b * q, triton.cdiv(max_kv_len, bk))](
        vis,
        sizes,
        past_lengths,
        cum,
        mask_out.view(torch.int8),
        q,
        *vis.stride(),
        BK=bk,
        num_warps=4 if bk >= 512 else 1,
        **pdl.launch(vis.device),
    )


def follow_path(
    draft_tokens: torch.Tensor,
    target_predict: torch.Tensor,
    parents: torch.Tensor,
    sizes: torch.Tensor,
    indices_out: torch.Tensor,
    tokens_out: torch.Tensor,
    lengths_out: torch.Tensor,
    next_out: torch.Tensor,
) -> None:
    """The greedy path (the root's token in column 0, the lowest-numbered matching child):
    draft_tokens / target_predict / parents [B, q] (any strides), sizes [>= B] -> writes rows [:B],
    columns [:q] of indices_out / tokens_out and entries [:B] of lengths_out / next_out (any strides).
    Inputs are validated by the caller."""
    walk(draft_tokens, target_predict, parents, sizes, indices_out, lengths_out, next_out,
         width=draft_tokens.shape[1], root_token=True, size_plus=0, largest=False,
         tokens_out=tokens_out)  # fmt: skip
