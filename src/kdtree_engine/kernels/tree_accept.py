"""The greedy walk of a draft tree on the GPU, one kernel for both layouts that walk it: ours (twin of
ref.tree.accept_greedy) and the SGLang port's (kernels/sglang_verify.follow_path, twin of
ref.sglang_verify.follow_verified_path).

One program per request keeps the request's parents and draft tokens in registers and walks from the
root: the wanted token is the target's prediction at the current node, the next node is a real child
drafted with it, and the walk ends at the first node without one. Among several such children ours
takes the largest index (as the official builder's dict overwrite does), the port's the smallest. The
path grows in a register vector and is written once at the end; no host reads, one launch of a fixed
grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.tree_types import AcceptResult, DraftTree


@triton.jit
def _walk_kernel(
    tok_ptr,  # [B, q - TOK_SHIFT] draft tokens of nodes TOK_SHIFT.. (ours: no root column)
    tgt_ptr,  # [B, q] target predictions per node
    par_ptr,  # [B, q] parents (node 0 is the root)
    size_ptr,  # [B] real nodes less SIZE_PLUS, clamped to [1, q] here
    path_out,  # [>= B, >= W] accepted node indices, -1 past the path (columns [:W] written)
    ptok_out,  # [>= B, >= W] accepted nodes' draft tokens (WITH_TOKENS)
    len_out,  # [>= B] path lengths (the root counted)
    next_out,  # [>= B] prediction at the last accepted node (the bonus token)
    q,
    W,
    tok_sb,
    tok_sc,
    tgt_sb,
    tgt_sc,
    par_sb,
    par_sc,
    path_sb,
    path_sc,
    ptok_sb,
    ptok_sc,
    len_s,
    next_s,
    QP: tl.constexpr,  # a power of two >= q and >= W: the register vectors' width
    TOK_SHIFT: tl.constexpr,
    SIZE_PLUS: tl.constexpr,
    LARGEST: tl.constexpr,
    WITH_TOKENS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, QP)
    size = tl.minimum(tl.maximum(tl.load(size_ptr + b).to(tl.int32) + SIZE_PLUS, 1), q)
    child_slot = (j >= 1) & (j < size)  # the slots that can be a child: real non-root nodes
    tok_row = tok_ptr + b * tok_sb
    tgt_row = tgt_ptr + b * tgt_sb
    par = tl.load(par_ptr + b * par_sb + j.to(tl.int64) * par_sc, mask=child_slot, other=-1)
    tok = tl.load(tok_row + (j - TOK_SHIFT).to(tl.int64) * tok_sc, mask=child_slot, other=0)

    path = tl.where(j == 0, 0, -1)  # slot s of the path: its s-th node, -1 past the end
    length = tl.full([], 1, tl.int32)
    cur = tl.zeros([], tl.int32)
    want = tl.load(tgt_row)
    moving = size > 1
    while moving:
        hit = child_slot & (par == cur) & (tok == want)
        if LARGEST:
            child = tl.max(tl.where(hit, j, -1), axis=0)
            moving = child >= 0
        else:
            child = tl.min(tl.where(hit, j, QP), axis=0)
            moving = child < QP
        if moving:
            path = tl.where(j == length, child, path)
            length += 1
            cur = child
            want = tl.load(tgt_row + child.to(tl.int64) * tgt_sc)
            moving = length < size  # a path never repeats a node, so it fits in `size` slots

    in_row = j < W
    col = j.to(tl.int64)
    tl.store(path_out + b * path_sb + col * path_sc, path, mask=in_row)
    if WITH_TOKENS:
        on_path = (path >= TOK_SHIFT) & in_row
        at = tl.where(on_path, path - TOK_SHIFT, 0).to(tl.int64)
        path_tok = tl.load(tok_row + at * tok_sc, mask=on_path, other=0)
        tl.store(ptok_out + b * ptok_sb + col * ptok_sc, path_tok, mask=in_row)
    tl.store(len_out + b * len_s, length)
    tl.store(next_out + b * next_s, want)


def walk(
    tokens: torch.Tensor,
    targets: torch.Tensor,
    parents: torch.Tensor,
    sizes: torch.Tensor,
    path_out: torch.Tensor,
    lengths_out: torch.Tensor,
    next_out: torch.Tensor,
    *,
    width: int,
    root_token: bool,
    size_plus: int,
    largest: bool,
    tokens_out: torch.Tensor | None = None,
) -> None:
    """The greedy walk of B trees of q node slots (targets / parents [B, q], any strides; tokens
    [B, q] with the root's column when root_token, else [B, q - 1]; sizes [B]: real nodes less
    size_plus). Writes rows [:B], columns [:width] of path_out (and tokens_out, the path's
    draft tokens, when given; the root's is 0 without a root column) and entries [:B] of lengths_out
    and next_out. Inputs are validated by the caller."""
    b, q = targets.shape
    if b == 0 or q == 0:
        return
    qp = triton.next_power_of_2(max(q, width))
    with_tokens = tokens_out is not None
    ptok = tokens_out if with_tokens else path_out
    _walk_kernel[(b,)](
        tokens,
        targets,
        parents,
        sizes,
        path_out,
        ptok,
        lengths_out,
        next_out,
        q,
        width,
        *tokens.stride(),
        *targets.stride(),
        *parents.stride(),
        *path_out.stride(),
        *ptok.stride(),
        lengths_out.stride(0),
        next_out.stride(0),
        QP=qp,
        TOK_SHIFT=0 if root_token else 1,
        SIZE_PLUS=size_plus,
        LARGEST=largest,
        WITH_TOKENS=with_tokens,
        num_warps=4 if qp >= 512 else 1,
        **pdl.launch(tokens.device),
    )


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """target_tokens [B, N] int64 contiguous (validated) -> AcceptResult, equal to the ref's."""
    b, depth = tree.batch_size, tree.max_depth
    i64 = dict(dtype=torch.int64, device=tree.device)
    accepted = torch.empty((b, depth + 1), **i64)
    lengths = torch.empty(b, **i64)
    bonus = torch.empty(b, **i64)
    walk(tree.tokens, target_tokens, tree.parents, tree.num_nodes, accepted, lengths, bonus,
         width=depth + 1, root_token=False, size_plus=1, largest=True)  # fmt: skip
    return AcceptResult(accepted=accepted, accept_len=lengths, bonus=bonus)
