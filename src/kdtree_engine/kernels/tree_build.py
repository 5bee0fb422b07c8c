"""Best-first DDTree build on the GPU: one Triton program per request, the heap kept in registers.

Exactness with the reference (ref/tree.py `build_one`, itself the official heap):
- scores are float64, updated in the official order: sibling `(s - lp[d-1, r]) + lp[d-1, r+1]`,
  child `s + lp[d, 0]`; no multiplications, so no FMA contraction can change a rounding;
- a candidate whose log-prob is -inf (a masked token) or NaN is never pushed (ref.tree.live), so
  every score is finite;
- ties on score go to the lexicographically smaller rank path. Instead of storing paths, every live
  candidate carries its rank `lex` in the lexicographic order of the live candidates. When the
  candidate P = (.., r) is popped, nothing lives between P and its new first child P + (0,) or between
  that child and P's next sibling (.., r + 1) (all of P's descendants are born later), so the child
  takes P's `lex`, the sibling the next one, and every later candidate shifts by (pushed - 1).

The frontier never holds more than `budget` candidates before a pop (one pop adds at most one net), so
CAP = next_pow2(budget) slots suffice; a pop's pushes that find no slot are pushes after the last pop.
A candidate packs (lex, parent, depth, rank) into one int64 with lex on top, so a single min-reduction
over the tied slots both breaks the tie and reads the winner's fields.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref.tree import MAX_BUDGET  # the bound is this kernel's: 15/16-bit lanes, CAP in registers
from kdtree_engine.tree_types import DraftTree

MAX_DEPTH = 1024  # lp[:, 0] of every depth is held in registers


@triton.jit
def _build_kernel(
    lp_ptr,  # [B, L, K] float32
    ids_ptr,  # [B, L, K] int64
    tok_ptr,  # [B, budget] int64 out
    dep_ptr,  # [B, budget] int64 out
    par_ptr,  # [B, budget + 1] int64 out
    cnt_ptr,  # [B] int64 out
    L,
    K,
    topk,
    tok_stride,  # row strides of the outputs (a caller's buffers may be wider than budget)
    dep_stride,
    par_stride,
    budget: tl.constexpr,  # the pop loop's bound (constexpr: one compile per budget, as a graph needs)
    CAP: tl.constexpr,
    LP2: tl.constexpr,
    PAD: tl.constexpr,  # token and depth of unused slots: -1 (DraftTree) or 0 (SGLang's layout)
    COUNT_ROOT: tl.constexpr,
    PDL: tl.constexpr = False,  # cnt_ptr gets the node count plus 1 (the root) when 1
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    lp_row = lp_ptr + b * L * K
    slots = tl.arange(0, CAP)
    neg_inf = float("-inf")
    big = 0x7FFFFFFFFFFFFFFF
    mask16 = 0xFFFF

    # lp[d, 0] for every depth, gathered once: the child update needs it at every pop.
    depth_ix = tl.arange(0, LP2)
    firsts = tl.load(lp_row + depth_ix * K, mask=depth_ix < L, other=0.0).to(tl.float64)

    first = tl.load(lp_row).to(tl.float64)
    score = tl.where(slots == 0, first, neg_inf)  # [CAP] float64
    info = tl.where(slots == 0, 1 << 16, 0).to(tl.int64)  # lex 0, parent 0, depth 1, rank 0
    valid = score > neg_inf  # slot 0, unless the first entry is masked (-inf, NaN): then no node
    nodes = tl.zeros([CAP], dtype=tl.int64)  # node n+1 -> parent << 32 | depth << 16 | rank
    nslots = 1
    count = 0
    for n in range(0, budget):
        best = tl.max(tl.where(valid, score, neg_inf), axis=0)
        tie = valid & (score == best)
        win = tl.min(tl.where(tie, info, big), axis=0)
        alive = win != big
        sel = tie & (info == win)
        lex = win >> 48
        parent = (win >> 32) & mask16
        depth = (win >> 16) & mask16
        rank = win & mask16

        in_row = alive & (rank + 1 < topk)
        base = lp_row + (depth - 1) * K + rank
        cur = tl.load(base, mask=alive, other=0.0).to(tl.float64)
        nxt = tl.load(base + 1, mask=in_row, other=neg_inf).to(tl.float64)
        below = tl.sum(tl.where(depth_ix == depth, firsts, 0.0), axis=0)  # lp[depth, 0]
        has_sib = in_row & (nxt > neg_inf)  # masked entries (-inf, NaN) are never pushed
        has_child = alive & (depth < L) & (below > neg_inf)
        s_sib = best - cur + nxt
        s_child = best + below

        node = lex * 0 + (n + 1)  # int64 (the loop index is int32)
        child_info = (lex << 48) | (node << 32) | ((depth + 1) << 16)
        sib_info = ((lex + has_child.to(tl.int64)) << 48) | (parent << 32) | (depth << 16) | (rank + 1)
        shift = has_child.to(tl.int64) + has_sib.to(tl.int64) - 1
        later = valid & alive & ((info >> 48) > lex)
        info = tl.where(later, info + (shift << 48), info)

        # The popped slot takes the child (else the sibling); a fresh slot takes the sibling when both.
        info = tl.where(sel, tl.where(has_child, child_info, sib_info), info)
        score = tl.where(sel, tl.where(has_child, s_child, s_sib), score)
        valid = tl.where(sel, has_child | has_sib, valid)
        fresh = (slots == nslots) & has_child & has_sib
        info = tl.where(fresh, sib_info, info)
        score = tl.where(fresh, s_sib, score)
        valid = valid | fresh
        nslots += (has_child & has_sib).to(tl.int32)

        nodes = tl.where((slots == n) & alive, (parent << 32) | (depth << 16) | rank, nodes)
        count += alive.to(tl.int32)

    node_ok = slots < count
    in_budget = slots < budget
    parent = tl.where(node_ok, (nodes >> 32) & mask16, -1)
    depth = tl.where(node_ok, (nodes >> 16) & mask16, PAD)
    rank = nodes & mask16
    tokens = tl.load(ids_ptr + b * L * K + (depth - 1) * K + rank, mask=node_ok, other=PAD)
    tl.store(tok_ptr + b * tok_stride + slots, tokens, mask=in_budget)
    tl.store(dep_ptr + b * dep_stride + slots, depth, mask=in_budget)
    tl.store(par_ptr + b * par_stride + 1 + slots, parent, mask=in_budget)
    tl.store(par_ptr + b * par_stride, -1)
    tl.store(cnt_ptr + b, count.to(tl.int64) + COUNT_ROOT)


def _empty_tree(b: int, budget: int, depth_limit: int, device) -> DraftTree:
    full = dict(dtype=torch.int64, device=device)
    return DraftTree(
        tokens=torch.full((b, budget), -1, **full),
        depths=torch.full((b, budget), -1, **full),
        parents=torch.full((b, budget + 1), -1, **full),
        num_nodes=torch.zeros(b, **full),
        max_depth=depth_limit,
    )


def build_tree(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int) -> DraftTree:
    """top_logprobs [B, L, K] float32 and top_ids [B, L, K] int64, contiguous and validated -> DraftTree.

    Equal to ref.tree.build_tree, ties included. One launch, no host synchronisation.
    """
    b, depth_limit, _ = top_logprobs.shape
    tree = _empty_tree(b, budget, depth_limit, top_logprobs.device)
    build_into(top_logprobs, top_ids, budget, tree.tokens, tree.depths, tree.parents, tree.num_nodes)
    return tree


def build_into(
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    budget: int,
    tokens: torch.Tensor,
    depths: torch.Tensor,
    parents: torch.Tensor,
    counts: torch.Tensor,
    *,
    pad: int = -1,
    count_root: bool = False,
) -> None:
    """build_tree written into given int64 buffers, rows [:B] of tokens/depths [>= B, >= budget],
    parents [>= B, >= budget + 1] (unit column stride) and counts [>= B]. Unused token and depth slots
    get `pad`; counts get the node count, plus 1 with count_root (a tree size with its root)."""
    b, depth_limit, k_avail = top_logprobs.shape
    if budget > MAX_BUDGET:
        raise ValueError(f"budget: impl='triton' supports budget <= {MAX_BUDGET}, got {budget}")
    if depth_limit > MAX_DEPTH:
        raise ValueError(f"top_logprobs: impl='triton' supports L <= {MAX_DEPTH}, got {depth_limit}")
    if b == 0:
        return
    if budget == 0 or depth_limit == 0:  # no node: padding only, as the kernel would write it
        tokens[:b, :budget] = pad
        depths[:b, :budget] = pad
        parents[:b, : budget + 1] = -1
        counts[:b] = int(count_root)
        return
    cap = triton.next_power_of_2(budget)
    _build_kernel[(b,)](
        top_logprobs,
        top_ids,
        tokens,
        depths,
        parents,
        counts,
        depth_limit,
        k_avail,
        min(budget, k_avail),
        tokens.stride(0),
        depths.stride(0),
        parents.stride(0),
        budget=budget,
        CAP=cap,
        LP2=triton.next_power_of_2(depth_limit),
        PAD=pad,
        COUNT_ROOT=int(count_root),
        num_warps=min(16, max(1, cap // 128)),
        **pdl.launch(top_logprobs.device),
    )
