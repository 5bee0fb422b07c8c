"""Hopper (sm_90) tree-verify MLA attention for few query rows per request ("swap"), in Gluon.

Why: with 64 query rows on the wgmma M side ("pipe"), a request of h = 8 heads and t = 9 nodes (72
rows, the 8-way tensor-parallel shape of Kimi-K2) needs two row blocks, the second 8/64 full, and
each block reads the whole cache: 1.78x the useful tensor work and twice the cache traffic. Here the
roles are swapped: the 64 cache slots of a tile are the M side and the request's query rows are N
(any multiple of 8 up to 40 per warpgroup), so every cache tile is read once per request and the
padding is at most 15 rows:

    S^T [64 slots, NQ] = K [64, 576] . Q^T [576, NQ]            (A = the cache tile, K-major)
    O^T [512, NQ]     += V^T [512, 64] . P^T [64, NQ]           (A = the same tile, transposed)

One warpgroup for up to 32 rows, two for 33-80 (each owns NQ / 2 query columns, so the softmax of a
column never leaves its warpgroup). O^T is eight accumulators of [64, NQ] (one per 64 latent dims).
The cache streams through a ring of NB boxes of 64 slots x 64 dims (8 KB, one TMA copy and one
mbarrier each; a tile is 9 boxes: the rope dims, then the latent dims in order), refilled box by box
as soon as every warp is done with one, so the copies run up to NB - 9 boxes ahead of the tensor
work. Schedule and outputs are those of the "sched" / "pipe" kernels with one row block per request
(kernels/mla_attention_sm90.schedule: balanced (request, tile) units, final rows or float32 partials
merged afterwards by kernels/mla_attention._merge). The mask (visibility, ancestor bits, or causal)
is applied to tiles that reach the tree or the request's end; cache rows past the end are read
(clamped into the request) and zeroed in shared memory before use.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .mla_attention_sm90 import _final_ptrs, _pipe_row, _row_block, _slot_ptrs, _zero_rows

BN: gl.constexpr = gl.constexpr(64)  # cache slots per tile (the wgmma M side)
BOX = 64  # dims per box; a tile is 1 rope box + D_C / BOX latent boxes
MAX_ROWS = 64  # t * h this kernel serves (two warpgroups of 32 query columns)
AUTO_ROWS = 0  # "auto" takes this kernel up to here (docs/attention.md, measured on the H200)
NB = gl.constexpr(16)  # ring boxes (128 KB): a tile (9 boxes) and 7 of the next


def layout(rows: int) -> tuple[int, int]:
    """(warpgroups, NQ = query columns incl. padding, a power of two) for `rows` query rows."""
    if rows <= 32:
        return 1, max(8, triton.next_power_of_2(rows))
    return 2, 64


@gluon.jit
def _issue_box(desc, ring, bars, seq, qbase, total, b, v_lo, seqlen, bt_ptr, stride_btb, cap, page_size,
               D_C: gl.constexpr, NB: gl.constexpr, PAGED: gl.constexpr):  # fmt: skip
    """Starts the TMA of box `seq` of this row block (boxes qbase .. qbase + total - 1; box 9 i + k of
    the block is box k of its tile i: k = 0 the rope dims, k >= 1 latent dims 64 (k - 1) ..) into
    ring slot seq % NB; nothing when seq is past the block's last box."""
    BOXES: gl.constexpr = D_C // 64 + 1
    rel = seq - qbase
    pred = rel < total
    tile = rel // BOXES
    k = rel - tile * BOXES
    row = _pipe_row(b, (v_lo + tile) * 64, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED)
    col = gl.where(k == 0, D_C, (k - 1) * 64)
    slot = seq % NB
    mbarrier.expect(bars.index(slot), 64 * 64 * 2, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], bars.index(slot), ring.index(slot), pred=pred)


@gluon.jit
def _stage_q_t(q_ptr, b, M, stride_qb, qr_smem, qc_smem, D_C: gl.constexpr, NQ: gl.constexpr,
               LD: gl.constexpr):  # fmt: skip
    """Request b's NQ query rows (zeros past M): the rope dims into qr_smem [NQ, 64], the latent dims
    into qc_smem [NQ, D_C], 64 at a time."""
    D: gl.constexpr = D_C + 64
    rows = gl.arange(0, NQ, gl.SliceLayout(1, LD))
    cols = gl.arange(0, 64, gl.SliceLayout(0, LD))
    base = q_ptr + b.to(gl.int64) * stride_qb + rows.to(gl.int64)[:, None] * D + cols[None, :]
    ok = (rows < M)[:, None] & (cols >= 0)[None, :]
    gl.thread_barrier()  # every warp is done with the previous request's Q
    qr_smem.store(gl.load(base + D_C, mask=ok, other=0.0))
    for k in gl.static_range(D_C // 64):
        qc_smem.slice(k * 64, 64, dim=1).store(gl.load(base + k * 64, mask=ok, other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _mask_t(s, vis_ptr, b, pos, prefix, seqlen, M, H, stride_vb, stride_vi, s_layout: gl.constexpr,
            MASK_MODE: gl.constexpr):  # fmt: skip
    """Scores s^T [64 slots, NQ] of a tile that reaches the tree or the request's end: -inf where
    slot pos is past seqlen, or a tree slot j = pos - prefix that query column n (node n // H) does not
    see (visibility [b, t, t] uint8 for MASK_MODE 0, ancestor bits [b, t] int64 for 1, j <= node for
    2 = causal)."""
    NQ: gl.constexpr = s.shape[1]
    n = gl.arange(0, NQ, gl.SliceLayout(0, s_layout))
    node = n // H
    col_ok = n < M
    j = pos - prefix  # [64]
    ok = ((j >= 0) & (pos < seqlen))[:, None] & col_ok[None, :]
    if MASK_MODE == 0:
        ptrs = vis_ptr + b.to(gl.int64) * stride_vb + node[None, :] * stride_vi + j[:, None]
        tree = ok & (gl.load(ptrs, mask=ok, other=0) != 0)
    elif MASK_MODE == 1:
        bits = gl.load(vis_ptr + b.to(gl.int64) * stride_vb + node, mask=col_ok, other=0)
        shift = gl.minimum(gl.maximum(j, 0), 63).to(gl.int64)
        tree = ok & (((bits[None, :] >> shift[:, None]) & 1) != 0)
    else:
        tree = ok & (j[:, None] <= node[None, :])
    return gl.where(tree | (j < 0)[:, None], s, float("-inf"))


@gluon.jit
def _store_t(o, c, l_i, o_ptr, M, D_C: gl.constexpr, s_layout: gl.constexpr):
    """Accumulator c of O^T ([64 dims, NQ], dims 64 c ..) / l -> o_ptr [M, D_C] in its dtype."""
    NQ: gl.constexpr = o.shape[1]
    out = o / gl.where(l_i > 0, l_i, 1.0)[None, :]
    d = c * 64 + gl.arange(0, 64, gl.SliceLayout(1, s_layout))
    n = gl.arange(0, NQ, gl.SliceLayout(0, s_layout))
    ptrs = o_ptr + n.to(gl.int64)[None, :] * D_C + d[:, None]
    gl.store(ptrs, out.to(o_ptr.dtype.element_ty), mask=(n < M)[None, :] & (d >= 0)[:, None])


@gluon.jit
def _store_all(o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, o_ptr, lse_ptr, M, D_C: gl.constexpr,
               s_layout: gl.constexpr):  # fmt: skip
    """The request's rows: O (normalized) into o_ptr [M, D_C], log-sum-exp (natural log, -inf for a row
    that saw no slot) into lse_ptr [M]."""
    _store_t(o0, 0, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o1, 1, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o2, 2, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o3, 3, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o4, 4, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o5, 5, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o6, 6, l_i, o_ptr, M, D_C, s_layout)
    _store_t(o7, 7, l_i, o_ptr, M, D_C, s_layout)
    seen = l_i > 0
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    n = gl.arange(0, o0.shape[1], gl.SliceLayout(0, s_layout))
    gl.store(lse_ptr + n, lse, mask=n < M)


@gluon.jit
def _swap_kernel(
    q_ptr,  # [b, M, D_C + 64] (M = t * h rows, row = node * h + head)
    desc,  # TMA descriptor of the cache viewed as [rows, D_C + 64], boxes of 64 x 64
    seqlens_ptr,
    bt_ptr,
    vis_ptr,
    out_ptr,  # [b, M, D_C] in q's dtype: requests one program covers whole
    lse_ptr,  # [b, M] float32
    part_ptr,  # [b, J, M, D_C] float32: slot j of a cut request = its j-th program
    plse_ptr,  # [b, J, M] float32
    T,
    H,
    M,
    NT,  # 64-slot tiles per request in the schedule (cdiv(max seqlen, 64))
    PER,  # tiles per program
    n_units,  # b * NT
    qk_scale,  # softmax scale * log2(e)
    cap,  # rows per request of a contiguous cache
    page_size,
    stride_qb,
    stride_btb,
    stride_vb,
    stride_vi,
    stride_pb,
    stride_ps,
    stride_lb,
    stride_ls,
    D_C: gl.constexpr,
    NQ: gl.constexpr,
    PAGED: gl.constexpr,
    MASK_MODE: gl.constexpr,
    num_warps: gl.constexpr,
):
    c = gl.program_id(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    BOXES: gl.constexpr = D_C // 64 + 1
    WG: gl.constexpr = num_warps // 4
    u0 = c * PER
    u1 = gl.minimum(u0 + PER, n_units)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, NQ // WG, 16]
    )
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    ld_z: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    box_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], dtype)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, 64], dtype)

    qr_smem = gl.allocate_shared_memory(dtype, [NQ, 64], q_sl)
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, D_C], dtype)
    qc_smem = gl.allocate_shared_memory(dtype, [NQ, D_C], qc_sl)
    p_smem = gl.allocate_shared_memory(dtype, [NQ, BN], q_sl)  # P (query columns x slots), K-major
    ring = gl.allocate_shared_memory(dtype, [NB, BN, 64], box_sl)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(NB):
        mbarrier.init(bars.index(k), count=1)
    s_zero = gl.zeros([BN, NQ], gl.float32, s_layout)
    slots = gl.arange(0, BN, gl.SliceLayout(1, s_layout))

    qbase = 0  # boxes this program has started: box seq sits in slot seq % NB, phase (seq // NB) % 2
    for rb in range(u0 // NT, (u1 - 1) // NT + 1):
        b, _blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _row_block(rb, u0, u1, 1, NT, seqlens_ptr, T, BN)
        n = gl.maximum(v_end - v_lo, 0)
        total = n * BOXES
        # the ring is empty here: start the first boxes, then stage Q while they land
        for first in range(gl.minimum(total, NB)):
            _issue_box(desc, ring, bars, qbase + first, qbase, total, b, v_lo, seqlen, bt_ptr, stride_btb,
                       cap, page_size, D_C, NB, PAGED)  # fmt: skip
        _stage_q_t(q_ptr, b, M, stride_qb, qr_smem, qc_smem, D_C, NQ, ld_q)

        o0 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o1 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o2 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o3 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o4 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o5 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o6 = gl.zeros([BN, NQ], gl.float32, s_layout)
        o7 = gl.zeros([BN, NQ], gl.float32, s_layout)
        m_i = gl.full([NQ], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
        l_i = gl.zeros([NQ], gl.float32, gl.SliceLayout(0, s_layout))
        for i in range(n):
            v = v_lo + i
            q = qbase + i * BOXES
            if v * BN + BN > seqlen:  # the request's last tile: zero the rows past its end
                for k in gl.static_range(BOXES):
                    mbarrier.wait(bars.index((q + k) % NB), ((q + k) // NB) & 1)
                for k in gl.static_range(BOXES):
                    _zero_rows(ring.index((q + k) % NB), v * BN, seqlen, ld_z)
                fence_async_shared()
                gl.thread_barrier()
            s = s_zero
            for k in gl.static_range(BOXES):
                slot = (q + k) % NB
                mbarrier.wait(bars.index(slot), ((q + k) // NB) & 1)
                if k == 0:
                    qk = qr_smem
                else:
                    qk = qc_smem.slice((k - 1) * 64, 64, dim=1)
                s = warpgroup_mma(ring.index(slot), qk.permute((1, 0)), s, use_acc=k > 0, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if v >= n_free:
                s = _mask_t(s, vis_ptr, b, v * BN + slots, prefix, seqlen, M, H, stride_vb, stride_vi,
                            s_layout, MASK_MODE)  # fmt: skip
            s = s * qk_scale
            m_new = gl.maximum(m_i, gl.max(s, 0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a column that has seen nothing yet
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[None, :])
            l_i = l_i * alpha + gl.sum(p, 0)
            m_i = m_new
            p_smem.store(gl.permute(p.to(dtype), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()  # P visible; every warp is past its scores: the rope box is free
            _issue_box(desc, ring, bars, q + NB, qbase, total, b, v_lo, seqlen, bt_ptr, stride_btb, cap,
                       page_size, D_C, NB, PAGED)  # fmt: skip
            a = alpha[None, :]
            pt = p_smem.permute((1, 0))
            o0 = warpgroup_mma(ring.index((q + 1) % NB).permute((1, 0)), pt, o0 * a, is_async=True)
            o1 = warpgroup_mma(ring.index((q + 2) % NB).permute((1, 0)), pt, o1 * a, is_async=True)
            o2 = warpgroup_mma(ring.index((q + 3) % NB).permute((1, 0)), pt, o2 * a, is_async=True)
            o3 = warpgroup_mma(ring.index((q + 4) % NB).permute((1, 0)), pt, o3 * a, is_async=True)
            o4 = warpgroup_mma(ring.index((q + 5) % NB).permute((1, 0)), pt, o4 * a, is_async=True)
            o5 = warpgroup_mma(ring.index((q + 6) % NB).permute((1, 0)), pt, o5 * a, is_async=True)
            o6 = warpgroup_mma(ring.index((q + 7) % NB).permute((1, 0)), pt, o6 * a, is_async=True)
            o7 = warpgroup_mma(ring.index((q + 8) % NB).permute((1, 0)), pt, o7 * a, is_async=True)
            o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=4, deps=(o0, o1, o2, o3))
            gl.thread_barrier()  # every warp is done with the first four latent boxes
            for k in gl.static_range(1, 5):
                _issue_box(desc, ring, bars, q + k + NB, qbase, total, b, v_lo, seqlen, bt_ptr, stride_btb,
                           cap, page_size, D_C, NB, PAGED)  # fmt: skip
            o4, o5, o6, o7 = warpgroup_mma_wait(num_outstanding=0, deps=(o4, o5, o6, o7))
            gl.thread_barrier()  # and with the rest, and with P
            for k in gl.static_range(5, BOXES):
                _issue_box(desc, ring, bars, q + k + NB, qbase, total, b, v_lo, seqlen, bt_ptr, stride_btb,
                           cap, page_size, D_C, NB, PAGED)  # fmt: skip
        qbase += total

        if (v_lo == 0) & (v_hi == NT):  # the whole request: final output
            final, final_lse = _final_ptrs(out_ptr, lse_ptr, b, M, D_C)
            _store_all(o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, final, final_lse, M, D_C, s_layout)
        else:
            split, split_lse = _slot_ptrs(part_ptr, plse_ptr, b, c, rb, NT, PER, stride_pb, stride_ps,
                                          stride_lb, stride_ls)  # fmt: skip
            _store_all(o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, split, split_lse, M, D_C, s_layout)
    for k in gl.static_range(NB):
        mbarrier.invalidate(bars.index(k))


def applies(kv_cache: torch.Tensor, paged: bool, rows: int, d_c: int) -> bool:
    """The swap kernel serves up to MAX_ROWS query rows per request with d_c = 512, reading the cache
    by TMA in 64-row boxes (a contiguous cache, pages of a multiple of 64 rows)."""
    ok_pages = not paged or kv_cache.shape[1] % 64 == 0
    return rows <= MAX_ROWS and d_c == 512 and kv_cache.is_contiguous() and ok_pages


def chosen(variant: str | None, kv_cache: torch.Tensor, paged: bool, rows: int, d_c: int) -> bool:
    """Whether a sm_90 call runs this kernel: pinned ("swap"), or under "auto" for up to AUTO_ROWS
    query rows per request where it applies."""
    if variant is not None:
        return variant == "swap"
    return rows <= AUTO_ROWS and applies(kv_cache, paged, rows, d_c)


def launch(q, kv_cache, cache_seqlens, bt, vis, mask_mode, stride_vb, stride_vi, out, lse, part, plse, t, h,
           rows, qk_scale, paged, page_size, programs, per, tiles):  # fmt: skip
    """Runs the swap kernel over the schedule (programs, per, tiles) of mla_attention_sm90.schedule with
    one row block per request and 64-slot tiles."""
    b, d = q.shape[0], q.shape[-1]
    d_c = out.shape[-1]
    wg, nq = layout(rows)
    flat = kv_cache.view(-1, d)
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    box = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    desc = TensorDescriptor(flat, list(flat.shape), [d, 1], [64, 64], box)
    _swap_kernel[(programs,)](
        q, desc, cache_seqlens, bt, vis, out, lse, part, plse,
        t, h, rows, tiles, per, b * tiles, qk_scale, kv_cache.shape[1], page_size,
        q.stride(0), bt.stride(0), stride_vb, stride_vi,
        part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, NQ=nq, PAGED=paged, MASK_MODE=mask_mode, num_warps=4 * wg,
    )  # fmt: skip
