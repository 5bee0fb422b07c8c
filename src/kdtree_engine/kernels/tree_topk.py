"""Vocabulary top-k and log-softmax normalizer of draft logits, the kernel twin of ref.tree.logits_to_topk.

Two launches. `_partials_kernel`, grid (rows, blocks of NORM_BLOCK logits), reads the logits once: per
block the max of every group of G logits and of every super group of S logits, and the block's
normalizer partial (its max and the int64 fixed-point sum of exp(x - max)). `_select_kernel`, grid
(rows,): the row's normalizer from its block partials; T0 = the k-th largest super-group max, a lower
bound of the k-th largest logit, by bisection over V / S values; the groups whose max is >= T0 are
listed in one pass over the group maxima, and their logits >= T0 (about k) are compacted as int64 keys
`ordered(value) << 32 | (2^32 - 1 - id)`, distinct and ordered by value then smaller id, and sorted in
registers.

Rows where that overflows (more than MAXG groups or KC logits >= T0: plateaus of equal logits, coarse
bf16 values, top logits crowded into a few groups) take the exact path (_exact_select), whose work is
bounded by k, not V. Order units (super groups, groups, logits) by (max, then smaller index): the top k
logits lie in the top k groups, and those in the top k super groups, because of two units with equal
maxima the one with the smaller index holds smaller ids. So it selects the top k super groups (in
registers, from the maxima already loaded), then the top k of their k * S / G groups, then the top k of
those groups' k * G logits. Each of the last two levels is a radix select of the k-th largest value
(6-bit digits, one histogram pass per digit, started from the level above's k-th value as a lower
bound: when fewer than k items exceed it, as on plateaus, the first pass ends the search) and one pass
that takes every item above that value and the first ties in index order. Per row that is at most
2 (digits + 1) passes over k * 32 items (digits: 3 for bf16, 4 for fp16, 6 for fp32), against
the fast path's one pass over the V / G group maxima and about k groups of logits.

The normalizer runs the operations of ref.tree.log_normalizer one for one: IEEE-754 adds, multiplies,
max, conversions and integer bit manipulation, no library exp or log, launched with fused
multiply-add off, and integer sums, so it is bit for bit the reference's on any device.
Output: (top_logprobs [B, L, k] float32 = logit - normalizer, top_ids [B, L, k] int64), equal to
ref.tree.logits_to_topk.
"""

from __future__ import annotations

import os
from functools import partial

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._device import multiprocessors
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref import tree as ref

LOW32 = tl.constexpr(0xFFFFFFFF)
NONE = tl.constexpr(-(2**63))  # below every packed key
LOG2E = tl.constexpr(ref.LOG2E)
D_MIN = tl.constexpr(ref.D_MIN)
ROUND = tl.constexpr(ref.ROUND)
ROUND_BITS = tl.constexpr(0x4B400000)  # the float32 bits of ROUND
FRAC_BITS = tl.constexpr(ref.FRAC_BITS)
EXP2_POLY = tl.constexpr(ref.EXP2_POLY)
LOG1P_POLY = tl.constexpr(ref.LOG1P_POLY)
SQRT2 = tl.constexpr(ref.SQRT2)
LN2_HI = tl.constexpr(ref.LN2_HI)
LN2_LO = tl.constexpr(ref.LN2_LO)


@triton.jit
def _fma(a, b, c, EMULATE: tl.constexpr):
    """float32 a * b + c rounded once: the GPU's fma, or under the interpreter (whose tl.fma rounds twice)
    ref.tree.fma32's float64 emulation. a, b, c: float32 tensors of one shape."""
    if EMULATE:
        p = a.to(tl.float64) * b.to(tl.float64)
        c64 = c.to(tl.float64)
        s = p + c64
        back = s - p
        err = (p - (s - back)) + (c64 - back)
        bits = s.to(tl.int64, bitcast=True)
        toward = tl.where((err > 0) == (s > 0), 1, -1)
        bits = tl.where((err != 0) & ((bits & 1) == 0), bits + toward, bits)
        return bits.to(tl.float64, bitcast=True).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _exp_nonpositive(d, SHIFT: tl.constexpr, EMULATE: tl.constexpr):
    """ref.tree.exp_nonpositive(d) * 2^SHIFT, bit for bit (d float32): n is read from the low bits of
    d log2(e) + ROUND, and 2^(n + SHIFT) is built from its exponent bits."""
    d = tl.maximum(d, D_MIN)
    log2e = tl.full(d.shape, LOG2E, tl.float32)
    rnd = tl.full(d.shape, ROUND, tl.float32)
    u = _fma(d, log2e, rnd, EMULATE)
    r = _fma(d, log2e, rnd - u, EMULATE)
    p = tl.full(d.shape, EXP2_POLY[5], tl.float32)
    for i in tl.static_range(4, -1, -1):
        p = _fma(p, r, tl.full(d.shape, EXP2_POLY[i], tl.float32), EMULATE)
    n = u.to(tl.int32, bitcast=True) - ROUND_BITS
    return p * ((n + (127 + SHIFT)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _log_fixed(s):
    """ref.tree.log_fixed: int64 s >= 2^FRAC_BITS -> float64 ln(s 2^-FRAC_BITS), the same operations."""
    hi = s >> 32
    f = hi.to(tl.float64) * 4294967296.0 + (s - (hi << 32)).to(tl.float64)
    bits = f.to(tl.int64, bitcast=True)
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)
    big = m > SQRT2
    m = tl.where(big, m * 0.5, m)
    e = ((bits >> 52) - 1023 + big.to(tl.int64) - FRAC_BITS).to(tl.float64)
    t = m - 1.0
    q = tl.full(t.shape, LOG1P_POLY[10], tl.float64)
    for i in tl.static_range(9, -1, -1):
        q = q * t + LOG1P_POLY[i]  # a rounded multiply, then a rounded add
    return (e * LN2_HI + t * q) + e * LN2_LO


@triton.jit
def _normalizer(bmax_ptr, bsum_ptr, row, NB, NBP: tl.constexpr, EMULATE: tl.constexpr):
    """ref.tree.log_normalizer of one row from its block partials (max, fixed-point sum)."""
    b = tl.arange(0, NBP)
    m_b = tl.load(bmax_ptr + row * NB + b, mask=b < NB, other=float("-inf"))
    s_b = tl.load(bsum_ptr + row * NB + b, mask=b < NB, other=0)
    m = tl.max(m_b, axis=0)
    scaled = s_b.to(tl.float64) * _exp_nonpositive(m_b - m, 0, EMULATE).to(tl.float64)
    s = tl.sum(scaled.to(tl.int64), axis=0)
    return (m.to(tl.float64) + _log_fixed(s)).to(tl.float32)


@triton.jit
def _ordered32(x):
    """float32 -> int32 key with the same order; -0.0 is folded onto +0.0 (they tie as floats)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _partials_kernel(x_ptr, gmax_ptr, smax_ptr, bmax_ptr, bsum_ptr, V, NG, NS, NB, CH: tl.constexpr,
                     G: tl.constexpr, S: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
    """Block c of a row (CH logits, a [CH // G, G] tile: 16-byte loads for bf16 when V is a multiple of
    8): the max of every group of G and super group of S logits (S a multiple of G dividing CH), the
    block max and the block's fixed-point sum of exp(x - max) (ref.tree.log_normalizer)."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CH + tl.arange(0, CH // G)[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + row * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    gmax = tl.max(x, axis=1)  # [CH // G]
    groups = c * (CH // G) + tl.arange(0, CH // G)
    tl.store(gmax_ptr + row * NG + groups, gmax, mask=groups < NG)
    smax = tl.max(tl.reshape(gmax, [CH // S, S // G]), axis=1)
    sup = c * (CH // S) + tl.arange(0, CH // S)
    tl.store(smax_ptr + row * NS + sup, smax, mask=sup < NS)
    m = tl.max(gmax, axis=0)
    fixed = _exp_nonpositive(x - tl.where(m == float("-inf"), 0.0, m), FRAC_BITS, EMULATE).to(tl.int64)
    tl.store(bmax_ptr + row * NB + c, m)
    tl.store(bsum_ptr + row * NB + c, tl.sum(tl.sum(fixed, axis=0), axis=0))  # in-thread sums first


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
def _emit(top, rank, k, lse, lp_out, ids_out, row):
    """Writes the first k of the sorted packed keys `top` as (logit - lse, id); the logit is decoded
    from the key (the map is an involution), so no logits are read again."""
    keep = rank < k
    ids = LOW32 - (top & LOW32)
    key = (top >> 32).to(tl.int32)
    vals = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tl.store(ids_out + row * k + rank, ids, mask=keep)
    tl.store(lp_out + row * k + rank, vals - lse, mask=keep)


@triton.jit
def _items(val_ptr, plist, npar, N, t0, TT: tl.constexpr, R: tl.constexpr):
    """Items t0 .. t0 + TT of a level of the exact path: item j is child j % R of parent plist[j // R]
    (child index parent * R + j % R, valid below N). Returns their keys (_ordered32 of the float32
    values at val_ptr), child indices (int32) and validity, in list order."""
    j = t0 + tl.arange(0, TT)
    pos = j // R
    child = tl.load(plist + pos, mask=pos < npar, other=0) * R + j % R
    ok = (pos < npar) & (child < N)
    key = _ordered32(tl.load(val_ptr + child, mask=ok, other=0.0).to(tl.float32))
    return key, child, ok


@triton.jit
def _kth_value(val_ptr, plist, npar, N, low, k, TT: tl.constexpr, R: tl.constexpr, KPR: tl.constexpr,
               SHIFT: tl.constexpr, NPASS: tl.constexpr, DB: tl.constexpr):  # fmt: skip
    """Radix select over the items of a level (_items; at most KPR): (t, n_gt), t the k-th largest
    shifted key (key >> SHIFT) among the items above `low`, or `low` when fewer than k are above it;
    n_gt the number of items above t. Pass p histograms digit p (DB bits of u = (key >> SHIFT) - MINK,
    from the top of its 32 - SHIFT bits) of the items whose higher digits equal t's so far; the first
    pass also counts the items above `low` and, if fewer than k, ends the search (then t = low: the
    caller guarantees that at least k items are >= low, or that all items are above it)."""
    NBITS: tl.constexpr = 32 - SHIFT
    MINK: tl.constexpr = -(1 << (31 - SHIFT))  # the lowest shifted key (below every float's)
    BINS: tl.constexpr = 1 << DB
    bins = tl.arange(0, BINS)
    low = low.to(tl.int32)
    kk = k  # rank of t among the items that share the digits found so far
    pre = tl.zeros([], tl.int64)  # the digits of t's u found so far
    n_gt = tl.zeros([], tl.int32)
    n_low = tl.zeros([], tl.int32)
    go = k > 0
    for p in tl.static_range(NPASS):
        lo = DB * (NPASS - 1 - p)  # constexprs
        dmask = (1 << min(DB, NBITS - lo)) - 1
        hmask = (1 << max(NBITS - lo - DB, 0)) - 1
        pre32 = pre.to(tl.int32)  # < 2^(NBITS - lo - DB) <= 2^31
        h = tl.zeros([BINS], tl.int32)
        for t0 in range(0, KPR, TT):  # constant trip count; tiles past the list are skipped
            if (t0 < npar * R) & go:
                key, child, ok = _items(val_ptr, plist, npar, N, t0, TT, R)
                sk = key >> SHIFT
                u = sk ^ MINK  # its low NBITS bits are sk - MINK
                hit = ok & (sk > low) & (((u >> (lo + DB)) & hmask) == pre32)
                h += tl.histogram((u >> lo) & dmask, BINS, mask=hit)
        total = tl.sum(h, axis=0)
        if p == 0:
            n_low = total
            go = total >= k
        suffix = total - tl.cumsum(h, axis=0) + h  # items in this bin or above, per bin
        b = tl.sum((suffix >= kk).to(tl.int32), axis=0) - 1  # the bin of the kk-th largest
        above = tl.sum(tl.where(bins == b, suffix - h, 0), axis=0)
        kk -= above
        n_gt += above
        pre = pre * BINS + b.to(tl.int64)
    t = tl.where(go, (pre + MINK).to(tl.int32), low)
    return t, tl.where(go, n_gt, n_low)


@triton.jit
def _take(val_ptr, plist, npar, N, t, n_gt, k, out, TT: tl.constexpr, R: tl.constexpr, KPR: tl.constexpr,
          SHIFT: tl.constexpr, PACK: tl.constexpr):  # fmt: skip
    """The top k items of a level, by (shifted key, then list order), given t and n_gt of _kth_value:
    every item above t and the first k - n_gt equal to t, written in list order to `out`: their child
    indices (int32), or with PACK their packed keys (int64, key << 32 | 2^32 - 1 - child)."""
    need = k - n_gt
    n_eq = tl.zeros([], tl.int32)
    n_out = tl.zeros([], tl.int32)
    for t0 in range(0, KPR, TT):
        if t0 < npar * R:
            key, child, ok = _items(val_ptr, plist, npar, N, t0, TT, R)
            sk = key >> SHIFT
            eq = ok & (sk == t)
            sel = (ok & (sk > t)) | (eq & (n_eq + tl.cumsum(eq.to(tl.int32), axis=0) <= need))
            pos = n_out + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            if PACK:
                tl.store(out + pos, (key.to(tl.int64) << 32) + (LOW32 - child.to(tl.int64)), mask=sel)
            else:
                tl.store(out + pos, child, mask=sel)
            n_eq += tl.sum(eq.to(tl.int32), axis=0)
            n_out += tl.sum(sel.to(tl.int32), axis=0)
    return n_out


@triton.jit
def _exact_select(x_ptr, gmax_ptr, sk_s, ok_s, sidx, top, glist, keys_row, row, V, NG, k, lse, lp_out,
                  ids_out, G: tl.constexpr, RS: tl.constexpr, KP: tl.constexpr, HT: tl.constexpr,
                  SHIFT: tl.constexpr, NPASS: tl.constexpr, DB: tl.constexpr):  # fmt: skip
    """Exact top-k of one row with any ties, in three levels of (max, then smaller index) order: the top
    k logits lie in the top k groups, and those in the top k super groups (of two tied units, the one
    with the smaller index holds smaller ids). Level 1, in registers: the top k super groups from their
    maxima sk_s (shifted keys) and the k-th largest, top (the lowest key when k > NS: all of them).
    Level 2: the top k groups among their k * RS groups; level 3: the top k logits among those groups'
    k * G logits. Each is a radix select of the k-th largest value (_kth_value, from the level above's
    k-th as a lower bound) and a pass that takes every item above it and the first ties in index order
    (_take). glist: [2 KP] int32 scratch of the row (the super-group list, then the group list)."""
    tl.debug_barrier()  # the fast path's readers of glist and keys are done
    gt = ok_s & (sk_s > top)
    eq = ok_s & (sk_s == top)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= k - tl.sum(gt.to(tl.int32), axis=0)))
    tl.store(glist + tl.cumsum(sel.to(tl.int32), axis=0) - 1, sidx, mask=sel)
    n_sup = tl.sum(sel.to(tl.int32), axis=0)
    tl.debug_barrier()
    # Tiles of HT items even when fewer are listed: a tile smaller than the program's threads would be
    # replicated across warps, which tl.histogram would count twice.
    gmax_row = gmax_ptr + row * NG
    clist = glist + KP
    N2: tl.constexpr = max(KP * RS, HT)
    t_g, n_gt = _kth_value(gmax_row, glist, n_sup, NG, top, k, HT, RS, N2, SHIFT, NPASS, DB)
    n_grp = _take(gmax_row, glist, n_sup, NG, t_g, n_gt, k, clist, HT, RS, N2, SHIFT, False)
    tl.debug_barrier()
    x_row = x_ptr + row * V
    N3: tl.constexpr = max(KP * G, HT)
    t_x, n_gt = _kth_value(x_row, clist, n_grp, V, t_g, k, HT, G, N3, SHIFT, NPASS, DB)
    _take(x_row, clist, n_grp, V, t_x, n_gt, k, keys_row, HT, G, N3, SHIFT, True)
    tl.debug_barrier()
    slot = tl.arange(0, KP)
    winners = tl.sort(tl.load(keys_row + slot, mask=slot < k, other=NONE), descending=True)
    _emit(winners, slot, k, lse, lp_out, ids_out, row)


@triton.jit
def _select_kernel(x_ptr, gmax_ptr, smax_ptr, bmax_ptr, bsum_ptr, glist_ptr, keys_ptr, lp_out, ids_out, V, NG,
                   NS, NB, k, G: tl.constexpr, RS: tl.constexpr, NGP: tl.constexpr, NSP: tl.constexpr,
                   NBP: tl.constexpr, MAXG: tl.constexpr, GW: tl.constexpr, KP: tl.constexpr,
                   KC: tl.constexpr, KS: tl.constexpr, TG: tl.constexpr, TGM: tl.constexpr, HT: tl.constexpr,
                   SHIFT: tl.constexpr, NPASS: tl.constexpr, DB: tl.constexpr,
                   EMULATE: tl.constexpr, RAW: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """The select of one row, after _partials_kernel. T0 = the k-th largest super-group max is a lower
    bound of the k-th largest logit (the k best super groups each hold a logit >= T0), found by
    bisection over NS values on keys shifted right by SHIFT (the low float32 bits that bf16 / fp16
    logits leave zero). Every top-k logit is >= T0 and sits in a group whose max is >= T0: one pass
    over the group maxima in TGM-wide tiles lists those groups (about k for smooth logits); their
    logits >= T0 are compacted as int64 keys (<= KC) and sorted. More than MAXG groups or KC logits
    (ties, or top logits crowded into few groups) -> _exact_select, whose work does not depend on V
    (RS = groups per super group). Scratch: glist [R, GW] int32, keys [R, KS] int64. RAW: write the
    logits themselves (no normalizer), for a vocabulary shard whose normalizer is combined later."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    if RAW:
        lse = 0.0
    else:
        lse = _normalizer(bmax_ptr, bsum_ptr, row, NB, NBP, EMULATE)
    sidx = tl.arange(0, NSP)
    skey = _ordered32(tl.load(smax_ptr + row * NS + sidx, mask=sidx < NS, other=float("-inf")))
    lo_key: tl.constexpr = -(1 << 31)
    hi_key: tl.constexpr = (1 << 31) - 1
    top = _kth_largest(skey >> SHIFT, sidx < NS, k, lo_key >> SHIFT, hi_key >> SHIFT, 33 - SHIFT)
    thr = tl.where(k > NS, lo_key, top << SHIFT).to(tl.int32)

    glist = glist_ptr + row * GW
    ncg = tl.zeros([], tl.int32)
    for t0 in range(0, NGP, TGM):  # constant trip count; tiles past NG are skipped
        if t0 < NG:
            g = t0 + tl.arange(0, TGM)
            cand = (g < NG) & (_ordered32(tl.load(gmax_ptr + row * NG + g, mask=g < NG, other=0.0)) >= thr)
            pos = ncg + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            tl.store(glist + pos, g, mask=cand & (pos < MAXG))  # a longer list is not read
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
            _emit(small, few, k, lse, lp_out, ids_out, row)
            done += 1
    if done == 0:
        _exact_select(x_ptr, gmax_ptr, skey >> SHIFT, sidx < NS, sidx, top, glist, keys_row, row, V, NG, k,
                      lse, lp_out, ids_out, G, RS, KP, HT, SHIFT, NPASS, DB)  # fmt: skip


_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13}  # float32 bits that are always zero
RADIX_BITS = 6  # digit of the exact path's radix select: 64-bin histograms, 3 passes for bf16, 6 for fp32


def logits_topk(logits: torch.Tensor, k: int, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, L, V] float (validated, 1 <= V <= ref.tree.MAX_VOCAB), 1 <= k <= V ->
    (top_logprobs [B, L, k] float32, top_ids [B, L, k] int64), equal to ref.tree.logits_to_topk.
    knobs: see topk_launches."""
    lp, ids, launches = topk_launches(logits, k, **knobs)
    for launch in launches:
        launch()
    return lp, ids


def shard_topk(logits: torch.Tensor, k: int, **knobs) -> tuple[torch.Tensor, ...]:
    """A vocabulary shard's part of the tensor-parallel top-k (integrations.sharded_topk): logits
    [B, L, Vs] -> (values [B, L, k] float32 logits, ids [B, L, k] int64 shard-local, block_max
    [B * L, nb] float32, block_sum [B * L, nb] int64), equal to ref.tree.topk_stable and
    ref.tree.block_partials of the shard (the normalizer's first pass, block = ref.NORM_BLOCK)."""
    values, ids, launches, bmax, bsum = _topk_plan(logits, k, raw=True, **knobs)
    for launch in launches:
        launch()
    return values, ids, bmax, bsum


def topk_launches(logits: torch.Tensor, k: int, **knobs) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The output buffers of logits_topk and its two launches as closures (the partials, then the
    select), so that each launch can be timed alone (scripts/probe_topk.py). Knobs: see _topk_plan."""
    lp, ids, launches, _, _ = _topk_plan(logits, k, **knobs)
    return lp, ids, launches


def _topk_plan(logits: torch.Tensor, k: int, *, block: int = ref.NORM_BLOCK, group: int | None = None,
               super_group: int | None = None, max_groups: int | None = None, max_compact: int | None = None,
               partial_warps: int = 1, select_warps: int | None = None, select_maxnreg: int | None = None,
               raw: bool = False) -> tuple:  # fmt: skip
    """Buffers and launches of the top-k: (lp or raw values, ids, (partials, select), block maxima,
    block sums); raw=True leaves the normalizer out of the values.

    Knobs (tests shrink them to reach the exact path at small shapes; max_groups=1 sends every row
    there when k >= 2 and V > G): block (logits per partials program, a power of two; the normalizer's
    block, so the reference must be given the same one), group (G, logits per group max), super_group
    (S), max_groups (MAXG, the fast path's capacity in groups), max_compact (KC, its capacity in
    logits), partial_warps (warps per partials program), select_warps and select_maxnreg (the select's
    warps and register cap per thread; default: 2 warps capped at 128 registers when there are more
    than 4 rows per multiprocessor, so that more rows' selects are resident at once, else 4 warps).
    Under the Triton interpreter (CPU) the group, super group, fast-path and exact-path tile sizes are
    smaller: its register sort is slow at the GPU's sizes."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    group = group or (8 if interpreting else 32)
    if block & (block - 1) or not group <= block <= 4096:
        raise ValueError(f"block: expected a power of two in [{group}, 4096], got {block}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()
    logits = logits.contiguous()
    b, depth, vocab = logits.shape
    rows, dev = b * depth, logits.device
    lp = torch.empty((b, depth, k), dtype=torch.float32, device=dev)
    ids = torch.empty((b, depth, k), dtype=torch.int64, device=dev)
    if rows == 0:
        return lp, ids, (), None, None
    chunk = max(group, min(block, triton.next_power_of_2(vocab)))  # one block: a shorter tile suffices
    sup = min(chunk, max(group, super_group or (64 if interpreting else 1024)))
    n_groups, n_sup, n_blocks = triton.cdiv(vocab, group), triton.cdiv(vocab, sup), triton.cdiv(vocab, chunk)
    gmax = torch.empty((rows, n_groups), dtype=torch.float32, device=dev)
    smax = torch.empty((rows, n_sup), dtype=torch.float32, device=dev)
    bmax = torch.empty((rows, n_blocks), dtype=torch.float32, device=dev)
    bsum = torch.empty((rows, n_blocks), dtype=torch.int64, device=dev)
    kp, ngp = triton.next_power_of_2(k), triton.next_power_of_2(n_groups)
    kc = max_compact or max(64, triton.next_power_of_2(8 * k))
    maxg = max_groups or max(16 if interpreting else 64, triton.next_power_of_2(4 * k))
    glist = torch.empty((rows, max(maxg, 2 * kp)), dtype=torch.int32, device=dev)
    keys = torch.empty((rows, max(kp, kc)), dtype=torch.int64, device=dev)
    shift = _KEY_SHIFT.get(logits.dtype, 0)
    tile = 256 if interpreting else 1024
    sizes = dict(G=group, RS=sup // group, NGP=ngp, NSP=triton.next_power_of_2(n_sup),
                 NBP=triton.next_power_of_2(n_blocks), MAXG=maxg, GW=glist.shape[1], KP=kp, KC=kc,
                 KS=max(kp, kc), TG=min(32, ngp), TGM=min(tile, ngp), HT=tile, SHIFT=shift,
                 NPASS=triton.cdiv(32 - shift, RADIX_BITS), DB=RADIX_BITS, EMULATE=interpreting)  # fmt: skip
    if select_warps is None:  # many rows: twice as many selects resident per multiprocessor
        many = not interpreting and rows > 4 * multiprocessors(logits.get_device())
        select_warps, select_maxnreg = (2, select_maxnreg or 128) if many else (4, select_maxnreg)
    if select_maxnreg:
        sizes["maxnreg"] = select_maxnreg
    head = (logits, gmax, smax, bmax, bsum)
    # contraction off: the normalizer's separate multiplies and adds round one by one, as the reference's
    partials = partial(_partials_kernel[(rows, n_blocks)], *head, vocab, n_groups, n_sup, n_blocks, CH=chunk,
                       G=group, S=sup, EMULATE=interpreting, num_warps=partial_warps,
                       enable_fp_fusion=False, **pdl.launch(dev))  # fmt: skip
    select = partial(_select_kernel[(rows,)], *head, glist, keys, lp, ids, vocab, n_groups, n_sup, n_blocks,
                     k, **sizes, RAW=raw, num_warps=select_warps, enable_fp_fusion=False,
                     **pdl.launch(dev))  # fmt: skip
    return lp, ids, (partials, select), bmax, bsum
