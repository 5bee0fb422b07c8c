"""Sampled (non-greedy) DDTree verify on the GPU, the twin of ref.sglang_sample.sample_path: three
launches of fixed shape, no host synchronisation.

1. `_walk_kernel`, one program per request: the tree walk (the slots' parents and tokens stay in
   registers across the q - 1 steps), then the reject node's child tokens, compacted to the front of
   their row, and each child's fixed-point probability (0 for a repeated token) into a scratch row.
2. `_block_sum_kernel`, one program per (request, vocab block): the fixed-point residual mass of the
   block, i.e. the block's int64 sum minus the masses of the child tokens that fall in it.
3. `_select_kernel`, one program per request: the int64 prefix of the block sums picks the block that
   holds the draw; inside it, the prefix of sub-block sums picks a sub-block, and a prefix over that
   sub-block's tokens (child tokens zeroed) picks the token. Every sum is int64, so the kernels and
   the reference agree bit for bit whatever the order of the additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref import sglang_sample as ref

_SCALE = tl.constexpr(float(1 << ref.FRAC_BITS))


@triton.jit
def _fixed(x):
    """trunc(x * 2^40) as int64 (ref.sglang_sample.to_fixed): exact in float32 and float64, so 16-bit
    inputs are widened to float32 first."""
    if x.dtype.primitive_bitwidth < 32:
        x = x.to(tl.float32)
    return (x * _SCALE).to(tl.int64)


@triton.jit
def _walk_kernel(
    probs_ptr,  # [bs, q, V], unit vocab stride
    s_prob_b,
    s_prob_n,
    tok_ptr,  # [bs, q] integer
    s_tok,
    par_ptr,  # [bs, q] integer
    s_par,
    size_ptr,  # [bs] integer (unread without HAS_SIZES)
    uni_ptr,  # [bs, q] float
    s_uni,
    acc_idx_ptr,  # [bs, q] int64 out
    s_acc_idx,
    acc_tok_ptr,  # [bs, q] int64 out
    s_acc_tok,
    len_ptr,  # [bs] int64 out
    rej_ptr,  # [bs] int64 out
    child_tok_ptr,  # [bs, q] int64 out
    s_child_tok,
    count_ptr,  # [bs] int64 out
    mass_ptr,  # [bs, q] int64 scratch out: fixed-point masses of the compacted children
    V,
    Q: tl.constexpr,
    QP: tl.constexpr,
    HAS_SIZES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, QP)
    in_q = slot < Q
    if HAS_SIZES:
        size = tl.load(size_ptr + b).to(tl.int64)
    else:
        size = tl.full([], Q, tl.int64)
    size = tl.minimum(tl.maximum(size, 1), Q)
    real = (slot > 0) & (slot < size)
    par = tl.load(par_ptr + b * s_par + slot, mask=real, other=-2).to(tl.int64)
    tok = tl.load(tok_ptr + b * s_tok + slot, mask=in_q, other=0).to(tl.int64)
    tok_ok = real & (tok >= 0) & (tok < V)
    node_rows = probs_ptr + b * s_prob_b

    # The accepted path lives in registers and is stored once at the end.
    path = tl.where(slot == 0, 0, -1).to(tl.int64)
    path_tok = tl.where(slot == 0, tok, 0)
    cur = tl.zeros([], tl.int64)
    length = tl.full([], 1, tl.int64)
    moving = tl.full([], 1, tl.int1)
    for _ in range(Q - 1):
        child = real & (par == cur) & moving
        p = tl.load(node_rows + cur * s_prob_n + tok, mask=child & tok_ok, other=0.0)
        prefix = tl.cumsum(_fixed(p), 0)
        u = _fixed(tl.load(uni_ptr + b * s_uni + cur))
        nxt = tl.min(tl.where(child & (u < prefix), slot, QP), axis=0).to(tl.int64)
        found = nxt < QP
        put = (slot == length) & found
        path = tl.where(put, nxt, path)
        path_tok = tl.where(put, tl.sum(tl.where(slot == nxt, tok, 0), axis=0), path_tok)
        length += found.to(tl.int64)
        cur = tl.where(found, nxt, cur)
        moving = found

    # The reject node's children (none when the walk never rejected, as in the port).
    children = real & (par == cur) & (~moving)
    count = tl.sum(children.to(tl.int64), axis=0)
    # A child token repeated under the node is masked once: only its first slot keeps a mass.
    repeat = tl.zeros([QP], tl.int1)
    for k in range(1, Q):
        par_k = tl.load(par_ptr + b * s_par + k).to(tl.int64)
        tok_k = tl.load(tok_ptr + b * s_tok + k).to(tl.int64)
        child_k = (k < size) & (par_k == cur) & (~moving)
        repeat |= child_k & (slot > k) & (tok == tok_k)
    first = children & (~repeat) & tok_ok
    mass = _fixed(tl.load(node_rows + cur * s_prob_n + tok, mask=first, other=0.0))

    # Compaction as a permutation (children to the front, the other slots after them), so that every
    # output address is written by exactly one element.
    as_child = children.to(tl.int64)
    dest = tl.where(children, tl.cumsum(as_child, 0) - 1, count + tl.cumsum(1 - as_child, 0) - 1)
    keep = dest < Q
    tl.store(child_tok_ptr + b * s_child_tok + dest, tl.where(children, tok, 0), mask=keep)
    tl.store(mass_ptr + b * Q + dest, tl.where(children, mass, 0), mask=keep)

    tl.store(acc_idx_ptr + b * s_acc_idx + slot, path, mask=in_q)
    tl.store(acc_tok_ptr + b * s_acc_tok + slot, path_tok, mask=in_q)
    tl.store(len_ptr + b, length)
    tl.store(rej_ptr + b, cur)
    tl.store(count_ptr + b, count)


@triton.jit
def _block_sum_kernel(
    probs_ptr,
    s_prob_b,
    s_prob_n,
    rej_ptr,
    child_tok_ptr,
    s_child_tok,
    mass_ptr,
    sums_ptr,  # [bs, NB] int64 out
    V,
    NB,
    Q: tl.constexpr,
    QP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    lo = blk * BLOCK_V
    v = lo + tl.arange(0, BLOCK_V)
    row = probs_ptr + b * s_prob_b + tl.load(rej_ptr + b) * s_prob_n
    raw = tl.sum(_fixed(tl.load(row + v, mask=v < V, other=0.0)), axis=0)
    k = tl.arange(0, QP)
    ctok = tl.load(child_tok_ptr + b * s_child_tok + k, mask=k < Q, other=-1)
    cmass = tl.load(mass_ptr + b * Q + k, mask=k < Q, other=0)  # 0 past the children
    here = (ctok >= lo) & (ctok < lo + BLOCK_V)
    tl.store(sums_ptr + b * NB + blk, raw - tl.sum(tl.where(here, cmass, 0), axis=0))


@triton.jit
def _first_above(prefix, ids, cut, none):
    """The smallest id whose inclusive prefix exceeds cut (`none` if no prefix does)."""
    return tl.min(tl.where(prefix > cut, ids, none), axis=0)


@triton.jit
def _largest_non_child(row, ctok, V, QP: tl.constexpr, CHUNK: tl.constexpr):
    """The non-child token of largest probability, smallest id on ties (0 if there is none): the
    draw when the residual holds no fixed-point mass."""
    best = tl.full([], float("-inf"), tl.float64)
    best_id = tl.zeros([], tl.int64)
    for lo in range(0, V, CHUNK):
        v = lo + tl.arange(0, CHUNK).to(tl.int64)
        p = tl.load(row + v, mask=v < V, other=0.0).to(tl.float64)
        member = tl.max(tl.where(v[:, None] == ctok[None, :], 1, 0), axis=1) > 0
        p = tl.where(member | (v >= V), float("-inf"), p)
        top = tl.max(p, axis=0)
        top_id = tl.min(tl.where(p == top, v, V), axis=0)
        better = top > best  # strict: an earlier chunk keeps its ties
        best = tl.where(better, top, best)
        best_id = tl.where(better, top_id, best_id)
    return best_id


@triton.jit
def _select_kernel(
    probs_ptr,
    s_prob_b,
    s_prob_n,
    rej_ptr,
    count_ptr,
    child_tok_ptr,
    s_child_tok,
    mass_ptr,
    sums_ptr,
    ufinal_ptr,
    next_ptr,  # [bs] int64 out
    V,
    NB,
    Q: tl.constexpr,
    QP: tl.constexpr,
    NBP: tl.constexpr,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    row = probs_ptr + b * s_prob_b + tl.load(rej_ptr + b) * s_prob_n
    # The cut t in [0, T) of the residual mass T.
    blocks = tl.arange(0, NBP)
    sums = tl.load(sums_ptr + b * NB + blocks, mask=blocks < NB, other=0)
    total = tl.sum(sums, axis=0)
    scaled = tl.load(ufinal_ptr + b).to(tl.float64) * total.to(tl.float64)
    cut = tl.minimum(scaled.to(tl.int64), total - 1)

    # Level 1: the block whose inclusive prefix first exceeds the cut, and the mass before it.
    blk = _first_above(tl.cumsum(sums, 0), blocks, cut, NBP).to(tl.int64)
    base = tl.sum(tl.where(blocks < blk, sums, 0), axis=0)
    lo = blk * (SUB * NSUB)

    # Level 2: the sub-block, from sub-block sums less the child masses inside each.
    k = tl.arange(0, QP)
    listed = k < tl.load(count_ptr + b)
    ctok = tl.load(child_tok_ptr + b * s_child_tok + k, mask=listed & (k < Q), other=-1)
    cmass = tl.load(mass_ptr + b * Q + k, mask=k < Q, other=0)
    subs = tl.arange(0, NSUB).to(tl.int64)
    v2 = lo + subs[:, None] * SUB + tl.arange(0, SUB)[None, :]
    raw = tl.sum(_fixed(tl.load(row + v2, mask=v2 < V, other=0.0)), axis=1)
    in_sub = (ctok[None, :] >= lo + subs[:, None] * SUB) & (ctok[None, :] < lo + (subs[:, None] + 1) * SUB)
    sub_sums = raw - tl.sum(tl.where(in_sub, cmass[None, :], 0), axis=1)
    sub = _first_above(base + tl.cumsum(sub_sums, 0), subs, cut, NSUB)
    base += tl.sum(tl.where(subs < sub, sub_sums, 0), axis=0)

    # Level 3: the token, child tokens zeroed.
    v = lo + sub * SUB + tl.arange(0, SUB).to(tl.int64)
    p = _fixed(tl.load(row + v, mask=v < V, other=0.0))
    member = tl.max(tl.where(v[:, None] == ctok[None, :], 1, 0), axis=1) > 0
    pick = _first_above(base + tl.cumsum(tl.where(member, 0, p), 0), v, cut, V)
    pick = tl.minimum(pick, V - 1)
    if total <= 0:
        pick = _largest_non_child(row, ctok, V, QP, SUB * NSUB)
    tl.store(next_ptr + b, pick)


def _split(block: int) -> tuple[int, int]:
    """A vocab block (a power of two) -> (SUB, NSUB), SUB * NSUB = block, both near sqrt(block)."""
    sub = 1 << (block.bit_length() - 1) // 2
    return sub, block // sub


def sample_into(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    actual_tree_sizes: torch.Tensor | None,
    uniform_samples: torch.Tensor,
    uniform_final: torch.Tensor,
    accepted_indices: torch.Tensor,
    accepted_token_ids: torch.Tensor,
    accepted_lens: torch.Tensor,
    next_tokens: torch.Tensor,
    reject_indices: torch.Tensor,
    reject_child_tokens: torch.Tensor,
    reject_child_counts: torch.Tensor,
    *,
    block: int | None = None,
) -> None:
    """Writes ref.sglang_sample.sample_path's outputs into the given views (validated by the caller):
    target_probs [bs, q, V], draft_tokens / parents [bs, q], actual_tree_sizes [bs] or None (= q),
    uniform_samples [bs, q] and uniform_final [bs] (already drawn); out: accepted_indices,
    accepted_token_ids, reject_child_tokens [bs, q] int64 and accepted_lens, next_tokens,
    reject_indices, reject_child_counts [bs] int64, each 2-D view with a unit column stride.
    block: the vocab block (a power of two >= 16; default 4096 on CUDA, 64 under the interpreter)."""
    bs, q, vocab = target_probs.shape
    if bs == 0:
        return
    if target_probs.stride(2) != 1:
        target_probs = target_probs.contiguous()
    cap = 4096 if target_probs.is_cuda else 64
    block = block or max(16, min(cap, triton.next_power_of_2(vocab)))
    sub, nsub = _split(block)
    nb = triton.cdiv(vocab, block)
    qp = max(16, triton.next_power_of_2(q))
    dev = target_probs.device
    mass = torch.empty((bs, q), dtype=torch.int64, device=dev)
    sums = torch.empty((bs, nb), dtype=torch.int64, device=dev)
    sizes = actual_tree_sizes if actual_tree_sizes is not None else accepted_lens  # unread without sizes
    probs = (target_probs, target_probs.stride(0), target_probs.stride(1))
    child = (reject_child_tokens, reject_child_tokens.stride(0))
    _walk_kernel[(bs,)](
        *probs,
        draft_tokens, draft_tokens.stride(0),
        parents, parents.stride(0),
        sizes,
        uniform_samples, uniform_samples.stride(0),
        accepted_indices, accepted_indices.stride(0),
        accepted_token_ids, accepted_token_ids.stride(0),
        accepted_lens, reject_indices, *child, reject_child_counts, mass,
        vocab, Q=q, QP=qp, HAS_SIZES=actual_tree_sizes is not None,
        num_warps=1 if qp <= 128 else 4,
        **pdl.launch(dev),
    )  # fmt: skip
    _block_sum_kernel[(bs, nb)](
        *probs, reject_indices, *child, mass, sums, vocab, nb, Q=q, QP=qp, BLOCK_V=block,
        num_warps=8 if block >= 2048 else 4,
        **pdl.launch(dev),
    )  # fmt: skip
    _select_kernel[(bs,)](
        *probs, reject_indices, reject_child_counts, *child, mass, sums, uniform_final, next_tokens,
        vocab, nb, Q=q, QP=qp, NBP=max(2, triton.next_power_of_2(nb)), SUB=sub, NSUB=nsub, num_warps=4,
        **pdl.launch(dev),
    )  # fmt: skip
