"""Greedy tree accept on the GPU (twin of ref.tree.accept_greedy): one program per request walks
from the root L times; at each step the child whose token equals the target's token at the current
node is taken (the largest such index, as the official dict overwrite does)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.tree_types import AcceptResult, DraftTree


@triton.jit
def _accept_kernel(
    tok_ptr,  # [B, N - 1] int64
    par_ptr,  # [B, N] int64
    cnt_ptr,  # [B] int64
    tgt_ptr,  # [B, N] int64
    acc_out,  # [B, L + 1] int64
    len_out,  # [B] int64
    bonus_out,  # [B] int64
    N,
    L: tl.constexpr,
    NP: tl.constexpr,
    LP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    used = tl.load(cnt_ptr + b) + 1
    real = (j >= 1) & (j < used)
    par = tl.load(par_ptr + b * N + j, mask=real, other=-2)
    tok = tl.load(tok_ptr + b * (N - 1) + j - 1, mask=real, other=-1)
    slot = tl.arange(0, LP)
    accepted = tl.where(slot == 0, 0, -1).to(tl.int64)
    cur = tl.zeros([], dtype=tl.int64)
    length = tl.full([], 1, dtype=tl.int64)
    target = tl.load(tgt_ptr + b * N + cur)
    for _ in range(L):
        nxt = tl.max(tl.where(real & (par == cur) & (tok == target), j, -1), axis=0).to(tl.int64)
        go = nxt >= 0
        accepted = tl.where((slot == length) & go, nxt, accepted)
        length += go.to(tl.int64)
        cur = tl.where(go, nxt, cur)
        target = tl.load(tgt_ptr + b * N + cur)
    tl.store(acc_out + b * (L + 1) + slot, accepted, mask=slot < L + 1)
    tl.store(len_out + b, length)
    tl.store(bonus_out + b, target)


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """target_tokens [B, N] int64 contiguous (validated) -> AcceptResult, equal to the ref's."""
    b, n, depth = tree.batch_size, tree.budget + 1, tree.max_depth
    i64 = dict(dtype=torch.int64, device=tree.device)
    accepted = torch.empty((b, depth + 1), **i64)
    lengths = torch.empty(b, **i64)
    bonus = torch.empty(b, **i64)
    if b:
        _accept_kernel[(b,)](
            tree.tokens.contiguous(),
            tree.parents.contiguous(),
            tree.num_nodes.contiguous(),
            target_tokens,
            accepted,
            lengths,
            bonus,
            n,
            L=depth,
            NP=triton.next_power_of_2(n),
            LP=triton.next_power_of_2(depth + 1),
            num_warps=1 if n <= 128 else 4,
        )
    return AcceptResult(accepted=accepted, accept_len=lengths, bonus=bonus)
