"""Attention of a DFlash drafter block over its context cache, read in place: the kernel twin of
ref/drafter_attention.py (same signature and contract).

One program per (request, kv head): its h/g query heads x T block rows form the M dimension (row
m = t * (h/g) + r is head kv_head * (h/g) + r of block row t), so each key tile is loaded once for every
head that shares it and no head is expanded. The context slots 0 .. new_len[b] - 1 are streamed in
BLOCK_N tiles straight from the cache (the bound read on the device: no host sync, so the launch is
captured in CUDA graphs), then the block's own T keys as one more tile; an online softmax in float32
(exp2 domain) accumulates P @ V in float32. Slots at or past new_len[b] are never loaded.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels._align import aligned, stride_align

BLOCK_N = 64
LOG2E = 1.4426950408889634


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


@triton.jit(do_not_specialize=["T", "stride_qb", "stride_cb", "stride_bb", "stride_ob"])
def _drafter_attention_kernel(
    q_ptr, ck_ptr, cv_ptr, len_ptr, kb_ptr, vb_ptr, out_ptr, T, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch,
    stride_bb, stride_bt, stride_bh, stride_ob, stride_ot, stride_oh,
    REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """q / out [B, T, h, D], cache k / v [B, S, g, D] (same strides), block k / v [B, T, g, D] (same
    strides); last dims contiguous; the batch strides multiples of ALIGN. Program (b, kv head)."""
    stride_qb, stride_cb = aligned(stride_qb, ALIGN), aligned(stride_cb, ALIGN)
    stride_bb, stride_ob = aligned(stride_bb, ALIGN), aligned(stride_ob, ALIGN)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
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
    n_len = tl.load(len_ptr + b)
    cache = b * stride_cb + kvh * stride_ch + offs_d[None, :]
    for start in range(0, n_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        rows = cache + n[:, None].to(tl.int64) * stride_cs
        acc, m_i, l_i = _tile_update(q, ck_ptr + rows, cv_ptr + rows, n < n_len, offs_d, acc, m_i, l_i,
                                     qk_scale, D, BLOCK_D, DOT_PREC)  # fmt: skip
    n = tl.arange(0, BLOCK_T)
    rows = b * stride_bb + n[:, None] * stride_bt + kvh * stride_bh + offs_d[None, :]
    acc, m_i, l_i = _tile_update(q, kb_ptr + rows, vb_ptr + rows, n < T, offs_d, acc, m_i, l_i, qk_scale,
                                 D, BLOCK_D, DOT_PREC)  # fmt: skip
    out = acc / l_i[:, None]  # l_i >= 1: every row sees its own block
    o_off = b * stride_ob + t * stride_ot + (kvh * REP + r) * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def drafter_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    new_len: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
) -> torch.Tensor:
    """q [B, T, h, d]; cache_k / cache_v [B, S, g, d] (views of one layer of a DrafterCache are fine),
    slots < new_len[b] read; new_len [B] int64 on the device; k_blk / v_blk [B, T, g, d] (strided
    views, e.g. of a fused qkv projection, are fine). Last dims contiguous, one dtype (float32, bf16
    or fp16). Returns out [B, T, h, d] contiguous in q's dtype. One launch, no host read."""
    b, t, h, d = q.shape
    g = k_blk.shape[2]
    if cache_v.stride() != cache_k.stride():  # the kernel reads both with one set of strides
        cache_k, cache_v = cache_k.contiguous(), cache_v.contiguous()
    if v_blk.stride() != k_blk.stride():
        k_blk, v_blk = k_blk.contiguous(), v_blk.contiguous()
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    _drafter_attention_kernel[(b, g)](
        q, cache_k, cache_v, new_len, k_blk, v_blk, out, t, LOG2E / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2), out.stride(0), out.stride(1), out.stride(2),
        ALIGN=stride_align(q.element_size(), q.stride(0), cache_k.stride(0), k_blk.stride(0), out.stride(0)),
        **launch_constants(t, h, g, d, q.dtype),
    )  # fmt: skip
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
