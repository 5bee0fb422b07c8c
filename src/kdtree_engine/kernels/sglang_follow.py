"""The greedy accepted path of DDTree trees in the SGLang port's layout, on the GPU (twin of
ref.sglang_verify.follow_verified_path).

One program per request keeps the request's parents and draft tokens in registers ([QP] each) and
walks from the root: the wanted token is the target's prediction at the current node, the next node is
the lowest-numbered real child drafted with it (a column minimum), and the walk ends at the first node
without such a child. The path grows in a register vector and is written once at the end; no host
reads, one launch of a fixed grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401


@triton.jit
def _follow_kernel(
    tok_ptr,  # [B, q] draft tokens (slot 0: the root)
    tgt_ptr,  # [B, q] target predictions
    par_ptr,  # [B, q] parents
    size_ptr,  # [B] real slots, clamped to [1, q] here
    idx_out,  # [>= B, >= q] accepted node indices
    acc_tok_out,  # [>= B, >= q] accepted draft tokens
    len_out,  # [>= B] path lengths
    next_out,  # [>= B] prediction at the last accepted node
    q,
    tok_sb,
    tok_sc,
    tgt_sb,
    tgt_sc,
    par_sb,
    par_sc,
    idx_sb,
    idx_sc,
    acc_sb,
    acc_sc,
    len_s,
    next_s,
    QP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, QP)
    size = tl.minimum(tl.maximum(tl.load(size_ptr + b).to(tl.int32), 1), q)
    child_slot = (j >= 1) & (j < size)  # the slots that can be a child: real non-root nodes
    tok_row = tok_ptr + b * tok_sb
    tgt_row = tgt_ptr + b * tgt_sb
    par = tl.load(par_ptr + b * par_sb + j.to(tl.int64) * par_sc, mask=child_slot, other=-1)
    tok = tl.load(tok_row + j.to(tl.int64) * tok_sc, mask=child_slot, other=0)

    path = tl.where(j == 0, 0, -1)  # slot s of the path: its s-th node, -1 past the end
    length = tl.full([], 1, tl.int32)
    cur = tl.zeros([], tl.int32)
    want = tl.load(tgt_row)
    moving = size > 1
    while moving:
        hit = child_slot & (par == cur) & (tok == want)
        child = tl.min(tl.where(hit, j, QP), axis=0)
        moving = child < QP
        if moving:
            path = tl.where(j == length, child, path)
            length += 1
            cur = child
            want = tl.load(tgt_row + child.to(tl.int64) * tgt_sc)
            moving = length < size  # a path never repeats a node, so it fits in `size` slots

    in_row = j < q
    on_path = path >= 0
    path_tok = tl.load(
        tok_row + tl.where(on_path, path, 0).to(tl.int64) * tok_sc, mask=on_path & in_row, other=0
    )
    col = j.to(tl.int64)
    tl.store(idx_out + b * idx_sb + col * idx_sc, path, mask=in_row)
    tl.store(acc_tok_out + b * acc_sb + col * acc_sc, path_tok, mask=in_row)
    tl.store(len_out + b * len_s, length)
    tl.store(next_out + b * next_s, want)


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
    """draft_tokens / target_predict / parents [B, q] (any strides), sizes [>= B] -> writes rows [:B],
    columns [:q] of indices_out / tokens_out and entries [:B] of lengths_out / next_out (any strides).
    Inputs are validated by the caller."""
    b, q = draft_tokens.shape
    if b == 0 or q == 0:
        return
    qp = triton.next_power_of_2(q)
    _follow_kernel[(b,)](
        draft_tokens,
        target_predict,
        parents,
        sizes,
        indices_out,
        tokens_out,
        lengths_out,
        next_out,
        q,
        *draft_tokens.stride(),
        *target_predict.stride(),
        *parents.stride(),
        *indices_out.stride(),
        *tokens_out.stride(),
        lengths_out.stride(0),
        next_out.stride(0),
        QP=qp,
        num_warps=4 if qp >= 512 else 1,
    )
