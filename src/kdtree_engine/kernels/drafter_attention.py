"""Attention of a DFlash drafter block over its context cache, read in place: the kernel twin of
ref/drafter_attention.py (same signature and contract).

A program per (request, kv head, split): its h/g query heads x T block rows form the M dimension (row
m = t * (h/g) + r is head kv_head * (h/g) + r of block row t), so each key tile is loaded once for every
head that shares it and no head is expanded. The context slots 0 .. new_len[b] - 1 are cut into
`num_splits` chunks of whole BLOCK_N tiles, sized from new_len[b] on the device (no host sync, so the
launch is captured in CUDA graphs), and each program streams its chunk straight from the cache; the
last split also takes the block's own T keys as one more tile. An online softmax in float32 (exp2
domain) accumulates P @ V in float32. With one split the program writes the output; with several each
writes its float32 partial and log-sum-exp, merged by kernels/mla_attention_merge.py (a split that saw
no key adds nothing). Slots at or past new_len[b] are never loaded.

Why splits: a drafter share under tensor parallelism holds few KV heads (Kimi-K2.5's DFlash drafter, 8
KV heads over 8 GPUs: one), so one program per (request, kv head) leaves a GPU's multiprocessors idle
while a single one streams the whole context (16 MB a layer at 32k tokens and d = 128). `pick_splits`
cuts the context only where each split still streams SPLIT_BYTES or more, so short contexts (kimi-nano)
keep the one-launch path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._align import aligned, stride_align
from kdtree_engine.kernels._device import device_multiprocessors
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.kernels.mla_attention_merge import merge_splits

BLOCK_N = 64
LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # as the target's split-KV kernel: the merge folds them in rounds of 32
SPLIT_BYTES = 512 << 10  # the least context (K and V bytes) a split streams: more than a merge launch costs


@triton.jit
def _tile_update(q, k_ptrs, v_ptrs, ok, offs_d, acc, m_i, l_i, qk_scale, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """One key tile (rows `ok` of it valid): the online-softmax update of (acc, m_i, l_i)."""
    mask = ok[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptrs, mask=mask, other=0.0)  # [BN, BD]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BM, BN], log2 domain
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    v = tl.load(v_ptrs, mask=mask, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["T", "num_splits", "stride_qb", "stride_cb", "stride_bb", "stride_ob"])
def _drafter_attention_kernel(
    q_ptr, ck_ptr, cv_ptr, len_ptr, kb_ptr, vb_ptr, out_ptr, part_ptr, plse_ptr, T, num_splits, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch,
    stride_bb, stride_bt, stride_bh, stride_ob, stride_ot, stride_oh,
    REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, ALIGN: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """q / out [B, T, h, D], cache k / v [B, S, g, D] (same strides), block k / v [B, T, g, D] (same
    strides); last dims contiguous; the batch strides multiples of ALIGN. Program (b, kv head, split).
    SPLIT: num_splits > 1, the partials go to part [B, num_splits, T * h, D] and plse [B, num_splits,
    T * h] (float32, contiguous) instead of out."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    stride_qb, stride_cb = aligned(stride_qb, ALIGN), aligned(stride_cb, ALIGN)
    stride_bb, stride_ob = aligned(stride_bb, ALIGN), aligned(stride_ob, ALIGN)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    t, r = offs_m // REP, offs_m % REP
    row_ok = t < T
    q_off = b * stride_qb + t * stride_qt + (kvh * REP + r) * stride_qh
    q_mask = row_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)  # [BM, BD]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_len = tl.load(len_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(n_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_len)
    cache = b * stride_cb + kvh * stride_ch + offs_d[None, :]
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        rows = cache + n[:, None].to(tl.int64) * stride_cs
        acc, m_i, l_i = _tile_update(q, ck_ptr + rows, cv_ptr + rows, n < hi, offs_d, acc, m_i, l_i,
                                     qk_scale, D, BLOCK_D, DOT_PREC)  # fmt: skip
    if split == num_splits - 1:
        n = tl.arange(0, BLOCK_T)
        rows = b * stride_bb + n[:, None] * stride_bt + kvh * stride_bh + offs_d[None, :]
        acc, m_i, l_i = _tile_update(q, kb_ptr + rows, vb_ptr + rows, n < T, offs_d, acc, m_i, l_i,
                                     qk_scale, D, BLOCK_D, DOT_PREC)  # fmt: skip
    if SPLIT:
        seen = l_i > 0  # a split whose chunk is empty saw no key
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse2 = m_i + tl.math.log2(tl.where(seen, l_i, 1.0))  # log2 domain; the merge takes natural logs
        lse = tl.where(seen, lse2 * 0.6931471805599453, float("-inf"))
        heads = REP * tl.num_programs(1)  # h
        piece = (b * num_splits + split) * T * heads + t * heads + kvh * REP + r  # [BM] (b, split, t, head)
        tl.store(part_ptr + piece[:, None] * D + offs_d[None, :], out, mask=q_mask)
        tl.store(plse_ptr + piece, lse, mask=row_ok)
    else:
        out = acc / l_i[:, None]  # l_i >= 1: every row sees its own block
        o_off = b * stride_ob + t * stride_ot + (kvh * REP + r) * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def pick_splits(b: int, g: int, slots: int, d: int, itemsize: int, multiprocessors: int) -> int:
    """Splits of the context for b requests x g kv heads over a cache of `slots` rows (its capacity: the
    lengths live on the device): enough programs to fill the multiprocessors, each streaming at least
    SPLIT_BYTES of K and V, at most MAX_SPLITS; 1 where the context is short."""
    by_bytes = slots * 2 * d * itemsize // SPLIT_BYTES
    by_programs = -(-multiprocessors // max(b * g, 1))
    return max(1, min(MAX_SPLITS, by_bytes, by_programs))


def drafter_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    new_len: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, T, h, d]; cache_k / cache_v [B, S, g, d] (views of one layer of a DrafterCache are fine),
    slots < new_len[b] read; new_len [B] int64 on the device; k_blk / v_blk [B, T, g, d] (strided
    views, e.g. of a fused qkv projection, are fine). Last dims contiguous, one dtype (float32, bf16
    or fp16). Returns out [B, T, h, d] contiguous in q's dtype. No host read: one launch, or two (the
    merge) where the context is cut into splits (pick_splits; num_splits forces a count)."""
    b, t, h, d = q.shape
    g = k_blk.shape[2]
    if cache_v.stride() != cache_k.stride():  # the kernel reads both with one set of strides
        cache_k, cache_v = cache_k.contiguous(), cache_v.contiguous()
    if v_blk.stride() != k_blk.stride():
        k_blk, v_blk = k_blk.contiguous(), v_blk.contiguous()
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    if num_splits is None:
        sms = device_multiprocessors(q.device)
        num_splits = pick_splits(b, g, cache_k.shape[1], d, q.element_size(), sms)
    elif not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected an int in [1, {MAX_SPLITS}] or None, got {num_splits!r}")
    part = plse = out  # unread with one split
    if num_splits > 1:
        part = torch.empty(b, num_splits, t * h, d, dtype=torch.float32, device=q.device)
        plse = torch.empty(b, num_splits, t * h, dtype=torch.float32, device=q.device)
    _drafter_attention_kernel[(b, g, num_splits)](
        q, cache_k, cache_v, new_len, k_blk, v_blk, out, part, plse, t, num_splits, LOG2E / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2), out.stride(0), out.stride(1), out.stride(2),
        ALIGN=stride_align(q.element_size(), q.stride(0), cache_k.stride(0), k_blk.stride(0), out.stride(0)),
        SPLIT=num_splits > 1, **launch_constants(t, h, g, d, q.dtype),
        **pdl.launch(q.device),
    )  # fmt: skip
    if num_splits > 1:
        lse = torch.empty(b, t * h, dtype=torch.float32, device=q.device)
        merge_splits(part, plse, out.view(b, t * h, d), lse)
    return out


def launch_constants(t: int, h: int, g: int, d: int, dtype: torch.dtype) -> dict:
    """The kernel's constexprs and warps for T block rows, h / g heads, head_dim d: every query row of a
    kv head in one tile (tl.dot needs >= 16 rows and columns)."""
    rep = h // g
    return dict(
        REP=rep, D=d, BLOCK_M=max(16, triton.next_power_of_2(rep * t)), BLOCK_N=BLOCK_N,
        BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
