"""Vocab-wide top-k and log-softmax normalizer on the GPU (twin of ref.tree.logits_to_topk).

The logits are read once in full. Per chunk of a row (_chunk_partials): the max and the sum of exp
(for logsumexp), the max of every group of G consecutive logits and of every super group of S logits.
Per row, the select (_select_thresh_row): the row's logsumexp from the chunk partials; T0 = the k-th
largest super-group max, a lower bound of the k-th largest logit found by a short bisection over
V / S values; the groups whose max is >= T0 are listed in one pass over the group maxima, and their
logits >= T0 (about k) are compacted as int64 keys `ordered(value) << 32 | (2^32 - 1 - id)`, which
are distinct and order by value, then by smaller id, and sorted in registers. Heavy ties (more than
MAXG groups or KC logits) take the bisection path (_slow_select: the k-th key by bisection over the
candidate groups, value bits then id; then the k winners are collected and sorted).
Variants, same output: "thresh" (default: _partials2_kernel, then _select_thresh_kernel) and
"fused" (_fused_kernel: one launch; the last program of each row, told by an atomic counter, runs the
row's select; measured slower on the H200, see logits_topk). Earlier selects, kept for comparison
(hence the file's length): "compact" (_select_compact_kernel: T = the k-th largest group max by
bisection over all NG group maxima) and "sort" (_select_kernel: sorts every logit of the candidate
groups).
Output: (top_logprobs [B, L, k] float32 = logit - logsumexp, top_ids [B, L, k] int64), ids and their
order exactly those of ref.tree.topk_stable; the logsumexp is a float32 sum in another order than
torch's, so log-probs agree to float32 rounding.
"""

from __future__ import annotations

import os
from functools import partial

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels._device import multiprocessors

LOW32 = tl.constexpr(0xFFFFFFFF)
LOG2E = tl.constexpr(1.4426950408889634)
NONE = tl.constexpr(-(2**63))  # below every packed key


@triton.jit
def _ordered32(x):
    """float32 -> int32 key with the same order; -0.0 is folded onto +0.0 (they tie as floats)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _ordered(x):
    """_ordered32 widened to int64 (room for the id below it in packed keys)."""
    return _ordered32(x).to(tl.int64)


@triton.jit
def _partials_kernel(x_ptr, gmax_ptr, part_ptr, V, NG, NCH, CH: tl.constexpr, G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CH + tl.arange(0, CH)
    x = tl.load(x_ptr + row * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    groups = c * (CH // G) + tl.arange(0, CH // G)
    gmax = tl.max(tl.reshape(x, [CH // G, G]), axis=1)
    tl.store(gmax_ptr + row * NG + groups, gmax, mask=groups < NG)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    tl.store(part_ptr + (row * NCH + c) * 2, m)
    tl.store(part_ptr + (row * NCH + c) * 2 + 1, s)


@triton.jit
def _chunk_partials(x_ptr, gmax_ptr, smax_ptr, part_ptr, row, c, V, NG, NS, NCH, CH: tl.constexpr,
                    G: tl.constexpr, S: tl.constexpr, GROUP_EXP: tl.constexpr = False):  # fmt: skip
    """Chunk c of a row: the max of every group of G and super group of S logits (S a multiple of G
    dividing CH) and the chunk's (max, sum exp); the chunk is loaded as a [CH // G, G] tile (16-byte
    loads for bf16 when V is a multiple of 8). GROUP_EXP: the sum as sum_g exp(gmax_g - m) *
    sum(exp(x - gmax_g)) (no chunk-wide max before the exps)."""
    offs = c * CH + tl.arange(0, CH // G)[:, None] * G + tl.arange(0, G)[None, :]  # [CH // G, G]
    x = tl.load(x_ptr + row * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    gmax = tl.max(x, axis=1)  # [CH // G]
    groups = c * (CH // G) + tl.arange(0, CH // G)
    tl.store(gmax_ptr + row * NG + groups, gmax, mask=groups < NG)
    smax = tl.max(tl.reshape(gmax, [CH // S, S // G]), axis=1)
    sup = c * (CH // S) + tl.arange(0, CH // S)
    tl.store(smax_ptr + row * NS + sup, smax, mask=sup < NS)
    m = tl.max(gmax, axis=0)
    # exp(d) as exp2(d * log2 e): the same ex2.approx as tl.exp, without tl.exp's scaling for subnormal
    # results (terms below 2^-126 of the chunk max are flushed to zero): 3 fewer instructions per logit
    if GROUP_EXP:
        g_safe = tl.where(gmax == float("-inf"), 0.0, gmax)  # a group wholly past V
        per_group = tl.sum(tl.math.exp2((x - g_safe[:, None]) * LOG2E), axis=1)
        s = tl.sum(per_group * tl.math.exp2((gmax - m) * LOG2E), axis=0)
    else:
        s = tl.sum(tl.sum(tl.math.exp2((x - m) * LOG2E), axis=1), axis=0)
    tl.store(part_ptr + (row * NCH + c) * 2, m)
    tl.store(part_ptr + (row * NCH + c) * 2 + 1, s)


@triton.jit
def _partials2_kernel(x_ptr, gmax_ptr, smax_ptr, part_ptr, V, NG, NS, NCH, CH: tl.constexpr, G: tl.constexpr,
                      S: tl.constexpr, GROUP_EXP: tl.constexpr):  # fmt: skip
    """_partials_kernel plus the super-group maxima, grid (rows, chunks)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    _chunk_partials(x_ptr, gmax_ptr, smax_ptr, part_ptr, row, c, V, NG, NS, NCH, CH, G, S, GROUP_EXP)


@triton.jit
def _kth_largest(keys, ok, k, LO: tl.constexpr, HI: tl.constexpr, STEPS: tl.constexpr):
    """Largest t in [LO, HI] with #(ok & keys >= t) >= k (LO when none)."""
    lo = tl.full([], LO, tl.int64)
    hi = tl.full([], HI, tl.int64)
    for _ in range(STEPS):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((ok & (keys >= mid)).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return lo


@triton.jit
def _group_keys(x_ptr, glist_ptr, row, V, ncg, t0, TG: tl.constexpr, G: tl.constexpr):
    """Keys and ids [TG * G] of candidate groups t0 .. t0 + TG (listed in glist) of one row."""
    j = t0 + tl.arange(0, TG)
    grp = tl.load(glist_ptr + j, mask=j < ncg, other=0).to(tl.int64)
    idx = grp[:, None] * G + tl.arange(0, G)[None, :]
    ok = (j < ncg)[:, None] & (idx < V)
    x = tl.load(x_ptr + row * V + idx, mask=ok, other=0.0).to(tl.float32)
    return tl.reshape(_ordered(x), [TG * G]), tl.reshape(idx, [TG * G]), tl.reshape(ok, [TG * G])


@triton.jit
def _count(x_ptr, glist_ptr, row, V, ncg, key_t, id_t, TG: tl.constexpr, G: tl.constexpr, NGP: tl.constexpr):
    """#(key > key_t) + #(key == key_t & id <= id_t) over the candidate groups."""
    total = tl.zeros([], tl.int32)
    for t0 in range(0, NGP, TG):  # constant trip count; tiles past the list are skipped
        if t0 < ncg:
            key, idx, ok = _group_keys(x_ptr, glist_ptr, row, V, ncg, t0, TG, G)
            hit = ok & ((key > key_t) | ((key == key_t) & (idx <= id_t)))
            total += tl.sum(hit.to(tl.int32), axis=0)
    return total


@triton.jit
def _emit(x_ptr, row, V, top, rank, k, lse, lp_out, ids_out):
    """Writes the first k of the sorted packed keys `top` as (logit - lse, id)."""
    keep = rank < k
    ids = LOW32 - (top & LOW32)
    vals = tl.load(x_ptr + row * V + ids, mask=keep, other=0.0).to(tl.float32)
    tl.store(ids_out + row * k + rank, ids, mask=keep)
    tl.store(lp_out + row * k + rank, vals - lse, mask=keep)


@triton.jit
def _lse(part_ptr, row, NCH, NCHP: tl.constexpr):
    """logsumexp of one row from its per-chunk (max, sum exp) partials."""
    ch = tl.arange(0, NCHP)
    pm = tl.load(part_ptr + (row * NCH + ch) * 2, mask=ch < NCH, other=float("-inf"))
    ps = tl.load(part_ptr + (row * NCH + ch) * 2 + 1, mask=ch < NCH, other=0.0)
    m = tl.max(pm, axis=0)
    return m + tl.log(tl.sum(ps * tl.exp(pm - m), axis=0))


@triton.jit
def _slow_select(x_ptr, glist, keys_row, row, V, ncg, k, lse, lp_out, ids_out,
                 TG: tl.constexpr, G: tl.constexpr, NGP: tl.constexpr, KP: tl.constexpr):  # fmt: skip
    """Exact top-k of one row by bisection over its candidate groups (any number of ties): the k-th
    key's value key first, then among ties on it the id; then the k winners are collected and sorted.
    keys_row: [KP] int64 scratch of this row."""
    lo_key: tl.constexpr = -(1 << 31)
    lo = tl.full([], lo_key, tl.int64)
    hi = tl.full([], (1 << 31) - 1, tl.int64)
    for _ in range(33):
        mid = lo + (hi - lo + 1) // 2
        enough = _count(x_ptr, glist, row, V, ncg, mid - 1, -1, TG, G, NGP) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    kth_key = lo
    lo_id = tl.zeros([], tl.int64)
    hi_id = lo_id + V - 1
    for _ in range(33):
        mid = lo_id + (hi_id - lo_id) // 2
        enough = _count(x_ptr, glist, row, V, ncg, kth_key, mid, TG, G, NGP) >= k
        hi_id = tl.where(enough, mid, hi_id)
        lo_id = tl.where(enough, lo_id, mid + 1)
    base = tl.zeros([], tl.int32)
    for t0 in range(0, NGP, TG):
        if t0 < ncg:
            s_key, s_id, s_ok = _group_keys(x_ptr, glist, row, V, ncg, t0, TG, G)
            win = s_ok & ((s_key > kth_key) | ((s_key == kth_key) & (s_id <= lo_id)))
            pos = base + tl.cumsum(win.to(tl.int32), axis=0) - 1
            tl.store(keys_row + pos, (s_key << 32) + (LOW32 - s_id), mask=win)
            base += tl.sum(win.to(tl.int32), axis=0)
    tl.debug_barrier()
    slot = tl.arange(0, KP)
    winners = tl.sort(tl.load(keys_row + slot, mask=slot < k, other=NONE), descending=True)
    _emit(x_ptr, row, V, winners, slot, k, lse, lp_out, ids_out)


@triton.jit
def _select_kernel(
    x_ptr,  # [R, V] logits
    gmax_ptr,  # [R, NG] float32
    part_ptr,  # [R, NCH, 2] float32
    glist_ptr,  # [R, NGP] int32 scratch
    keys_ptr,  # [R, KP] int64 scratch
    lp_out,  # [R, k] float32
    ids_out,  # [R, k] int64
    V,
    NG,
    NCH,
    k,
    G: tl.constexpr,
    NGP: tl.constexpr,
    NCHP: tl.constexpr,
    MAXG: tl.constexpr,
    KP: tl.constexpr,
    TG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse = _lse(part_ptr, row, NCH, NCHP)

    g = tl.arange(0, NGP)
    gkey = _ordered(tl.load(gmax_ptr + row * NG + g, mask=g < NG, other=0.0))
    lo_key: tl.constexpr = -(1 << 31)
    thr = _kth_largest(gkey, g < NG, k, lo_key, (1 << 31) - 1, 33)
    thr = tl.where(k > NG, lo_key, thr)  # fewer groups than k: every logit is a candidate
    cand = (g < NG) & (gkey >= thr)
    ncg = tl.sum(cand.to(tl.int32), axis=0)
    glist = glist_ptr + row * NGP
    tl.store(glist + tl.cumsum(cand.to(tl.int32), axis=0) - 1, g, mask=cand)
    tl.debug_barrier()

    if ncg <= MAXG:
        key, idx, ok = _group_keys(x_ptr, glist, row, V, ncg, 0, MAXG, G)
        packed = tl.where(ok & (key >= thr), (key << 32) + (LOW32 - idx), NONE)
        top = tl.sort(packed, descending=True)
        _emit(x_ptr, row, V, top, tl.arange(0, MAXG * G), k, lse, lp_out, ids_out)
    else:
        _slow_select(x_ptr, glist, keys_ptr + row * KP, row, V, ncg, k, lse, lp_out, ids_out, TG, G, NGP, KP)


@triton.jit
def _select_compact_kernel(
    x_ptr,  # [R, V] logits
    gmax_ptr,  # [R, NG] float32
    part_ptr,  # [R, NCH, 2] float32
    glist_ptr,  # [R, NGP] int32 scratch
    keys_ptr,  # [R, KS] int64 scratch
    lp_out,  # [R, k] float32
    ids_out,  # [R, k] int64
    V,
    NG,
    NCH,
    k,
    G: tl.constexpr,
    NGP: tl.constexpr,
    NCHP: tl.constexpr,
    MAXG: tl.constexpr,
    KP: tl.constexpr,
    KC: tl.constexpr,
    KS: tl.constexpr,
    TG: tl.constexpr,
    SHIFT: tl.constexpr,
):
    """The "compact" variant of _select_kernel (same output): the group-max bisection runs on keys
    shifted right by SHIFT (16 for bf16, 13 for fp16: their low float32 bits are zero, so it is exact
    for them and only a looser, still valid, bound otherwise), and only the candidates >= T (about k)
    are compacted and sorted, KC at most; more than KC (heavy ties) go to the bisection path."""
    row = tl.program_id(0).to(tl.int64)
    lse = _lse(part_ptr, row, NCH, NCHP)
    g = tl.arange(0, NGP)
    gkey = _ordered(tl.load(gmax_ptr + row * NG + g, mask=g < NG, other=0.0))
    lo_key: tl.constexpr = -(1 << 31)
    hi_key: tl.constexpr = (1 << 31) - 1
    top = _kth_largest((gkey >> SHIFT).to(tl.int32), g < NG, k, lo_key >> SHIFT, hi_key >> SHIFT, 33 - SHIFT)
    thr = tl.where(k > NG, lo_key, top << SHIFT)
    cand = (g < NG) & (gkey >= thr)
    ncg = tl.sum(cand.to(tl.int32), axis=0)
    glist = glist_ptr + row * NGP
    tl.store(glist + tl.cumsum(cand.to(tl.int32), axis=0) - 1, g, mask=cand)
    tl.debug_barrier()

    done = tl.zeros([], tl.int32)
    if ncg <= MAXG:
        key, idx, ok = _group_keys(x_ptr, glist, row, V, ncg, 0, MAXG, G)
        sel = ok & (key >= thr)
        nsel = tl.sum(sel.to(tl.int32), axis=0)
        if nsel <= KC:
            pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(keys_ptr + row * KS + pos, (key << 32) + (LOW32 - idx), mask=sel)
            tl.debug_barrier()
            few = tl.arange(0, KC)
            small = tl.load(keys_ptr + row * KS + few, mask=few < nsel, other=NONE)
            _emit(x_ptr, row, V, tl.sort(small, descending=True), few, k, lse, lp_out, ids_out)
            done += 1
    if done == 0:
        _slow_select(x_ptr, glist, keys_ptr + row * KS, row, V, ncg, k, lse, lp_out, ids_out, TG, G, NGP, KP)


@triton.jit
def _emit_packed(top, rank, k, lse, lp_out, ids_out, row):
    """Writes the first k of the sorted packed keys `top` as (logit - lse, id); the logit is decoded
    from the key (the map is an involution), so no logits are read again."""
    keep = rank < k
    ids = LOW32 - (top & LOW32)
    key = (top >> 32).to(tl.int32)
    vals = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tl.store(ids_out + row * k + rank, ids, mask=keep)
    tl.store(lp_out + row * k + rank, vals - lse, mask=keep)


@triton.jit
def _select_thresh_row(x_ptr, gmax_ptr, smax_ptr, part_ptr, glist_ptr, keys_ptr, lp_out, ids_out, row,
                       V, NG, NS, NCH, k, G: tl.constexpr, NGP: tl.constexpr, NSP: tl.constexpr,
                       NCHP: tl.constexpr, MAXG: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                       KS: tl.constexpr, TG: tl.constexpr, TGM: tl.constexpr,
                       SHIFT: tl.constexpr):  # fmt: skip
    """The "thresh" select (same output as _select_kernel). T0 = the k-th largest super-group max (NS of
    them, S logits each) is a lower bound of the k-th largest logit (the k best super groups each hold
    a logit >= T0), found by a short bisection over NS values, not over the NG group maxima. Every
    top-k logit is >= T0 and sits in a group whose max is >= T0: one pass over the group maxima in
    TGM-wide tiles lists those groups (about k for smooth logits); their logits >= T0 are compacted as
    int64 keys (<= KC) and sorted. More than MAXG groups or KC logits (heavy ties) -> bisection path."""
    lse = _lse(part_ptr, row, NCH, NCHP)
    sidx = tl.arange(0, NSP)
    skey = _ordered32(tl.load(smax_ptr + row * NS + sidx, mask=sidx < NS, other=float("-inf")))
    lo_key: tl.constexpr = -(1 << 31)
    hi_key: tl.constexpr = (1 << 31) - 1
    top = _kth_largest(skey >> SHIFT, sidx < NS, k, lo_key >> SHIFT, hi_key >> SHIFT, 33 - SHIFT)
    thr = tl.where(k > NS, lo_key, top << SHIFT).to(tl.int32)

    glist = glist_ptr + row * NGP
    ncg = tl.zeros([], tl.int32)
    for t0 in range(0, NGP, TGM):  # constant trip count; tiles past NG are skipped
        if t0 < NG:
            g = t0 + tl.arange(0, TGM)
            cand = (g < NG) & (_ordered32(tl.load(gmax_ptr + row * NG + g, mask=g < NG, other=0.0)) >= thr)
            tl.store(glist + ncg + tl.cumsum(cand.to(tl.int32), axis=0) - 1, g, mask=cand)
            ncg += tl.sum(cand.to(tl.int32), axis=0)
    tl.debug_barrier()

    done = tl.zeros([], tl.int32)
    keys_row = keys_ptr + row * KS
    if ncg <= MAXG:
        nsel = tl.zeros([], tl.int32)
        for t0 in range(0, MAXG, TG):
            if t0 < ncg:
                j = t0 + tl.arange(0, TG)
                grp = tl.load(glist + j, mask=j < ncg, other=0)
                idx = grp[:, None] * G + tl.arange(0, G)[None, :]  # [TG, G]
                ok = (j < ncg)[:, None] & (idx < V)
                key = _ordered32(tl.load(x_ptr + row * V + idx, mask=ok, other=0.0).to(tl.float32))
                sel = tl.reshape(ok & (key >= thr), [TG * G])
                pos = nsel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                ids = tl.reshape(idx, [TG * G]).to(tl.int64)
                packed = (tl.reshape(key, [TG * G]).to(tl.int64) << 32) + (LOW32 - ids)
                tl.store(keys_row + pos, packed, mask=sel & (pos < KC))
                nsel += tl.sum(sel.to(tl.int32), axis=0)
        if nsel <= KC:
            tl.debug_barrier()
            few = tl.arange(0, KC)
            small = tl.sort(tl.load(keys_row + few, mask=few < nsel, other=NONE), descending=True)
            _emit_packed(small, few, k, lse, lp_out, ids_out, row)
            done += 1
    if done == 0:
        _slow_select(x_ptr, glist, keys_row, row, V, ncg, k, lse, lp_out, ids_out, TG, G, NGP, KP)


@triton.jit
def _select_thresh_kernel(
    x_ptr,  # [R, V] logits
    gmax_ptr,  # [R, NG] float32
    smax_ptr,  # [R, NS] float32
    part_ptr,  # [R, NCH, 2] float32
    glist_ptr,  # [R, NGP] int32 scratch
    keys_ptr,  # [R, KS] int64 scratch
    lp_out,  # [R, k] float32
    ids_out,  # [R, k] int64
    V,
    NG,
    NS,
    NCH,
    k,
    G: tl.constexpr,
    NGP: tl.constexpr,
    NSP: tl.constexpr,
    NCHP: tl.constexpr,
    MAXG: tl.constexpr,
    KP: tl.constexpr,
    KC: tl.constexpr,
    KS: tl.constexpr,
    TG: tl.constexpr,
    TGM: tl.constexpr,
    SHIFT: tl.constexpr,
):
    """The "thresh" select launch, grid (rows,), after _partials2_kernel."""
    row = tl.program_id(0).to(tl.int64)
    _select_thresh_row(x_ptr, gmax_ptr, smax_ptr, part_ptr, glist_ptr, keys_ptr, lp_out, ids_out, row,
                       V, NG, NS, NCH, k, G, NGP, NSP, NCHP, MAXG, KP, KC, KS, TG, TGM, SHIFT)  # fmt: skip


@triton.jit
def _fused_kernel(
    x_ptr,  # [R, V] logits
    gmax_ptr,  # [R, NG] float32
    smax_ptr,  # [R, NS] float32
    part_ptr,  # [R, NCH, 2] float32
    count_ptr,  # [R] int32, zero on entry and on exit
    glist_ptr,  # [R, NGP] int32 scratch
    keys_ptr,  # [R, KS] int64 scratch
    lp_out,  # [R, k] float32
    ids_out,  # [R, k] int64
    V,
    NG,
    NS,
    NCH,
    k,
    CH: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    NGP: tl.constexpr,
    NSP: tl.constexpr,
    NCHP: tl.constexpr,
    MAXG: tl.constexpr,
    KP: tl.constexpr,
    KC: tl.constexpr,
    KS: tl.constexpr,
    TG: tl.constexpr,
    TGM: tl.constexpr,
    SHIFT: tl.constexpr,
):
    """The "fused" variant, one launch, grid (R * NCH,) with a row's chunks adjacent (so a row's select
    runs while later rows still stream): each program writes its chunk's partials, then counts itself
    done on the row's counter; the last of the row (it sees NCH - 1) resets the counter and runs the
    "thresh" select. The barrier orders every thread's stores before the counter update; the update is
    acq_rel at GPU scope (Triton's defaults), so the other programs' stores, released by their updates,
    are visible to the last program's reads."""
    pid = tl.program_id(0)
    row = (pid // NCH).to(tl.int64)
    _chunk_partials(x_ptr, gmax_ptr, smax_ptr, part_ptr, row, pid % NCH, V, NG, NS, NCH, CH, G, S)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == NCH - 1:
        tl.store(count_ptr + row, 0)  # every program of the row has counted: no other access this launch
        _select_thresh_row(x_ptr, gmax_ptr, smax_ptr, part_ptr, glist_ptr, keys_ptr, lp_out, ids_out,
                           row, V, NG, NS, NCH, k, G, NGP, NSP, NCHP, MAXG, KP, KC, KS, TG, TGM,
                           SHIFT)  # fmt: skip


VARIANTS = ("fused", "thresh", "compact", "sort")
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13}  # float32 bits that are always zero


def logits_topk(
    logits: torch.Tensor,
    k: int,
    *,
    variant: str = "thresh",
    counter: torch.Tensor | None = None,
    group: int | None = None,
    max_groups: int | None = None,
    max_compact: int | None = None,
    chunk: int | None = None,
    super_group: int | None = None,
    partial_warps: int | None = None,
    select_warps: int | None = None,
    select_maxnreg: int | None = None,
    group_exp: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, L, V] float (validated, V >= 1), 1 <= k <= V ->
    (top_logprobs [B, L, k] float32, top_ids [B, L, k] int64), as ref.tree.logits_to_topk.

    variant: "thresh" (default: _partials2_kernel then _select_thresh_kernel: a threshold from
    super-group maxima, then only the logits >= it are sorted; 115 us at B=64, L=15, V=163840, k=32,
    bf16, on the H200, 2026-12-02 16:22 UTC, against 71 us for a Triton kernel that only reads the same
    logits and 97 us for torch.amax), "fused" (the
    same partials and select in one launch, the last program of each row doing the select; 183 us:
    the selects hold their block slots and slow the stream), "compact" (bisection over all group
    maxima; 198 us) or "sort" (sorts every logit of the candidate groups; 443 us); same output.
    counter ("fused" only): int32 [B * L] zeros on the logits' device, left zeroed by the launch; the
    caller keeps it and must not share it between launches that may overlap (another stream, another
    graph). Default: a fresh zeroed buffer per call (one memset), safe everywhere.
    Tuning knobs (tests shrink them to reach the fallbacks at small shapes): group (G logits per
    group max), max_groups (MAXG, the fast path's capacity in groups), max_compact (KC, its capacity
    in logits), chunk (logits per program of the partials; default 2048 for "thresh", 8192 for
    "fused", 4096 otherwise), super_group (S, "thresh" / "fused"; default 1024 for "thresh", 512 for
    "fused"), partial_warps (the partials' warps, the "fused" launch's too; default 1 for "thresh": one
    warp per 2048 logits needs no cross-warp reduction, measured 89 against 97 us for 4 warps per
    8192; 4 otherwise) / select_warps and select_maxnreg ("thresh" only: the select launch's warps and
    a register cap per thread, so that more rows' selects are resident at once; default: 2 warps
    capped at 128 registers when there are more than 4 rows per multiprocessor, measured 29 against
    37 us at B=64, L=15 on the H200, else 4 warps at the compiler's choice), group_exp ("thresh"
    only: the partials sum exp(x - group max) per group, then scale by exp(group max - chunk max), so
    the exps need no chunk-wide max first; one more exp per group). Under the Triton
    interpreter (CPU) the defaults are smaller, as its register sort costs seconds per row at the GPU's
    sizes.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    if counter is not None:
        rows = logits.shape[0] * logits.shape[1]
        if variant != "fused" or counter.dtype != torch.int32 or counter.shape != (rows,):
            raise ValueError(f"counter: expected int32 [{rows}] with variant 'fused', got "
                             f"{counter.dtype} {list(counter.shape)} with {variant!r}")  # fmt: skip
        if counter.device != logits.device or not counter.is_contiguous():
            raise ValueError(f"counter: expected contiguous on {logits.device}, got {counter.device}")
    lp, ids, stages = _plan(logits, k, variant=variant, counter=counter, group=group, max_groups=max_groups,
                            max_compact=max_compact, chunk=chunk, super_group=super_group,
                            partial_warps=partial_warps, select_warps=select_warps,
                            select_maxnreg=select_maxnreg, group_exp=group_exp)  # fmt: skip
    for launch in stages:
        launch()
    return lp, ids


def _plan(logits, k, *, variant="thresh", counter=None, group=None, max_groups=None, max_compact=None,
          chunk=None, super_group=None, partial_warps=None, select_warps=None, select_maxnreg=None,
          group_exp=False):  # fmt: skip
    """Output and scratch buffers and the launches of logits_topk as closures (the partials, then the
    select; one for "fused"), so that scripts/probe_topk.py can time each launch alone."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if group is None:
        group = 8 if interpreting else 32
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()
    logits = logits.contiguous()
    b, depth, vocab = logits.shape
    rows = b * depth
    dev = logits.device
    lp = torch.empty((b, depth, k), dtype=torch.float32, device=dev)
    ids = torch.empty((b, depth, k), dtype=torch.int64, device=dev)
    if rows == 0:
        return lp, ids, ()
    chunk = chunk or (1024 if interpreting else {"thresh": 2048, "fused": 8192}.get(variant, 4096))
    partial_warps = partial_warps or (1 if variant == "thresh" else 4)
    chunk = max(group, min(chunk, triton.next_power_of_2(vocab)))
    n_groups, n_chunks = triton.cdiv(vocab, group), triton.cdiv(vocab, chunk)
    gmax = torch.empty((rows, n_groups), dtype=torch.float32, device=dev)
    part = torch.empty((rows, n_chunks, 2), dtype=torch.float32, device=dev)
    kp = triton.next_power_of_2(k)
    ngp = triton.next_power_of_2(n_groups)
    tg = min(32, ngp)
    glist = torch.empty((rows, ngp), dtype=torch.int32, device=dev)
    nchp = triton.next_power_of_2(n_chunks)
    shift = _KEY_SHIFT.get(logits.dtype, 0)
    if variant in ("thresh", "fused"):
        default_sup = 64 if interpreting else 1024 if variant == "thresh" else 512
        sup = min(chunk, max(group, super_group or default_sup))
        n_sup = triton.cdiv(vocab, sup)
        smax = torch.empty((rows, n_sup), dtype=torch.float32, device=dev)
        maxg = max_groups or max(16 if interpreting else 64, triton.next_power_of_2(4 * k))
        kc = max_compact or max(64, triton.next_power_of_2(8 * k))
        keys = torch.empty((rows, max(kp, kc)), dtype=torch.int64, device=dev)
        sizes = dict(G=group, NGP=ngp, NSP=triton.next_power_of_2(n_sup), NCHP=nchp, MAXG=maxg, KP=kp, KC=kc)
        sizes.update(KS=max(kp, kc), TG=tg, TGM=min(256 if interpreting else 1024, ngp), SHIFT=shift)
        head, tail = (logits, gmax, smax, part), (glist, keys, lp, ids, vocab, n_groups, n_sup, n_chunks, k)
        if variant == "fused":
            if counter is None:  # stream-ordered by the caching allocator, a memset node under capture
                counter = torch.zeros(rows, dtype=torch.int32, device=dev)
            launch = _fused_kernel[(rows * n_chunks,)]
            sizes.update(CH=chunk, S=sup, num_warps=partial_warps)
            return lp, ids, (partial(launch, *head, counter, *tail, **sizes),)
        pargs = (*head, vocab, n_groups, n_sup, n_chunks)
        launch = _partials2_kernel[(rows, n_chunks)]
        sizes_p = dict(CH=chunk, G=group, S=sup, GROUP_EXP=group_exp, num_warps=partial_warps)
        partials = partial(launch, *pargs, **sizes_p)
        if select_warps is None:  # many rows: twice as many selects resident per multiprocessor
            many = not interpreting and rows > 4 * multiprocessors(logits.get_device())
            select_warps, select_maxnreg = (2, select_maxnreg or 128) if many else (4, select_maxnreg)
        if select_maxnreg:
            sizes["maxnreg"] = select_maxnreg
        select = partial(_select_thresh_kernel[(rows,)], *head, *tail, **sizes, num_warps=select_warps)
        return lp, ids, (partials, select)
    pargs = (logits, gmax, part, vocab, n_groups, n_chunks)
    partials = partial(_partials_kernel[(rows, n_chunks)], *pargs, CH=chunk, G=group)
    if max_groups is None:
        cap = 512 if interpreting else 8192
        max_groups = min(cap // group, max(16 if interpreting else 64, triton.next_power_of_2(2 * k)))
    sizes = dict(G=group, NGP=ngp, NCHP=nchp, MAXG=max_groups, KP=kp, TG=tg)
    if variant == "sort":
        keys = torch.empty((rows, kp), dtype=torch.int64, device=dev)
        args = (logits, gmax, part, glist, keys, lp, ids, vocab, n_groups, n_chunks, k)
        return lp, ids, (partials, partial(_select_kernel[(rows,)], *args, **sizes, num_warps=8))
    kc = max_compact or min(max_groups * group, max(64, triton.next_power_of_2(4 * k)))
    keys = torch.empty((rows, max(kp, kc)), dtype=torch.int64, device=dev)
    args = (logits, gmax, part, glist, keys, lp, ids, vocab, n_groups, n_chunks, k)
    sizes.update(KC=kc, KS=max(kp, kc), SHIFT=shift)
    return lp, ids, (partials, partial(_select_compact_kernel[(rows,)], *args, **sizes, num_warps=4))
