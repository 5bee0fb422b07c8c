"""A tree round's commit in one launch: twin of engine.commit.commit_round_ref (about a dozen small torch
kernels inside the captured accept stage: a gather of the accepted nodes' features, the token gather,
cat and scatter, the count, the bonus token and the cache length).

One program per (request, block of feature columns) copies the accepted nodes' feature rows of its
block into the drafter's context rows; the first block's program also writes the request's count, its
committed tokens, its context length, bonus token and cache length. Copies and integer arithmetic only:
the reference's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit
def _commit_kernel(
    count_ptr,  # [B] int64
    acc_ptr,  # [B, W] int64 accepted node indices, -1 padded
    new_bonus_ptr,  # [B] int64
    ids_ptr,  # [B, N] int64
    hidden_ptr,  # [B, N, F]
    active_ptr,  # [B] bool, viewed as int8
    ctx_ptr,  # [B, W, F] (strided rows), written
    ctx_lens_ptr,  # [B] int64, written
    committed_ptr,  # [B, >= 1 + SLOTS] int64, written
    bonus_ptr,  # [B] int64, updated
    start_ptr,  # [B] int64, updated
    W,
    F,
    SLOTS,
    acc_sb,
    ids_sb,
    hid_sb,
    hid_sn,
    ctx_sb,
    ctx_sr,
    com_sb,
    BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    i = tl.arange(0, BLOCK_W)
    node = tl.maximum(tl.load(acc_ptr + b * acc_sb + i, mask=i < W, other=0), 0)
    cols = block * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (i < W)[:, None] & (cols < F)[None, :]
    rows = tl.load(hidden_ptr + b * hid_sb + node[:, None] * hid_sn + cols[None, :], mask=mask)
    tl.store(ctx_ptr + b * ctx_sb + i[:, None] * ctx_sr + cols[None, :], rows, mask=mask)
    if block == 0:
        count = tl.load(count_ptr + b)
        new_bonus = tl.load(new_bonus_ptr + b)
        s = tl.arange(0, BLOCK_S)  # token slots
        nxt = tl.maximum(tl.load(acc_ptr + b * acc_sb + s + 1, mask=s + 1 < W, other=0), 0)
        tok = tl.load(ids_ptr + b * ids_sb + nxt, mask=s + 1 < W, other=0)
        tok = tl.where((s == W - 1) | (s == tl.maximum(count - 1, 0)), new_bonus, tok)
        tl.store(committed_ptr + b * com_sb + 1 + s, tok, mask=s < SLOTS)
        tl.store(committed_ptr + b * com_sb, count)
        tl.store(ctx_lens_ptr + b, count)
        active = tl.load(active_ptr + b) != 0
        tl.store(bonus_ptr + b, tl.where(active, new_bonus, tl.load(bonus_ptr + b)))
        tl.store(start_ptr + b, tl.load(start_ptr + b) + count)


def commit_round(count, accepted, bonus, ids, hidden, active, out, slots: int) -> None:
    """engine.commit.commit_round_ref in one launch (the same arguments; hidden's and ctx's feature
    columns, the round's 1-d tensors and the rows of accepted, ids and committed contiguous)."""
    b, w = accepted.shape
    f = hidden.shape[-1]
    if b == 0:
        return
    block_f = min(triton.next_power_of_2(f), 128)
    grid = (b, triton.cdiv(f, block_f))
    _commit_kernel[grid](
        count, accepted, bonus, ids, hidden, active.view(torch.int8), out.ctx, out.ctx_lens, out.committed,
        out.bonus, out.start, w, f, slots, accepted.stride(0), ids.stride(0), hidden.stride(0),
        hidden.stride(1), out.ctx.stride(0), out.ctx.stride(1), out.committed.stride(0),
        BLOCK_W=triton.next_power_of_2(w), BLOCK_S=triton.next_power_of_2(slots), BLOCK_F=block_f,
        num_warps=4, **pdl.launch(accepted.device),
    )  # fmt: skip
