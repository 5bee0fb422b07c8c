"""Hopper (sm_90) tree-verify MLA attention with warpgroup roles ("roles"), in Gluon.

Why: in "pipe" both warpgroups compute half of every score tile and half of every P V, so each
tile's softmax needs the two halves of each row (two cross-warpgroup reductions through shared
memory) and the tensor cores idle while both warpgroups run it. Here the two warpgroups have roles
(gl.warp_specialize), as in FlashMLA:

- warpgroup 0 (the default partition) stages Q, computes the whole score tile S = Q K^T [64, 64]
  (64 query rows, 64 cache slots: a row never leaves its warp, so the softmax needs no shared
  memory), runs the online softmax, hands P and the rescale factors to warpgroup 1 through shared
  memory, and accumulates the first half of O (latent columns 0 .. 255);
- warpgroup 1 (a worker partition) only accumulates the second half of O from the same P, so its
  tensor work on tile i overlaps warpgroup 0's scores and softmax of tile i + 1.

The 64-slot tile is three TMA groups (rope columns, first and second latent half), each in two
buffers with its own mbarriers, refilled two tiles ahead by the partition that frees it: warpgroup 0
the rope columns (after the scores) and the first half (after its P V), warpgroup 1 the second half
(after its P V). Schedule and outputs are those of "pipe" with 64-slot units (mla_attention_sm90.
schedule: balanced (row block, tile) units, final rows or float32 partials merged afterwards).
"""

import torch
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
from triton.language.core import _aggregate as aggregate

from .mla_attention_sm90 import (
    _final_ptrs,
    _pipe_row,
    _row_block,
    _slot_ptrs,
    _store_cols,
    _store_lse,
    _tree_mask,
    _zero_rows,
)

ROWS = 64  # query rows per row block, and cache slots per tile
BM = gl.constexpr(ROWS)
BN = gl.constexpr(ROWS)
WORKER_REGS = gl.constexpr(192)  # warpgroup 1's registers per thread (O half: 128); warpgroup 0 gets the rest


@aggregate
class Consts:
    """The kernel's compile-time parameters, as the partitions receive them (gl.warp_specialize passes
    plain constexpr arguments on as runtime values)."""

    D_C: gl.constexpr
    D_R: gl.constexpr
    PAGED: gl.constexpr
    MASK_MODE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, D_C, D_R, PAGED, MASK_MODE):
        self.D_C = gl.constexpr(D_C)
        self.D_R = gl.constexpr(D_R)
        self.PAGED = gl.constexpr(PAGED)
        self.MASK_MODE = gl.constexpr(MASK_MODE)


@gluon.jit
def _issue_group(desc, bars, bufs, g, i, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap, page_size,
                 CH0: gl.constexpr, NCH: gl.constexpr, D_C: gl.constexpr, PAGED: gl.constexpr):  # fmt: skip
    """TMA of one group of the row block's local tile i (program tile g), if the block has that tile
    (i < n): cache columns CH0 * 64 .. (CH0 + NCH) * 64 of the tile's 64 rows into the same columns of
    buffer g % 2 of bufs (the rope buffers take CH0 = D_C / 64 into their columns 0 ..); bar g % 2
    completes when the group has landed."""
    row = _pipe_row(b, (v_lo + i) * BN, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED)
    bar = bars.index(g % 2)
    dst = bufs.index(g % 2)
    pred = i < n
    mbarrier.expect(bar, NCH * 64 * 64 * 2, pred=pred)
    for k in gl.static_range(NCH):
        chunk = dst.slice((CH0 + k) * 64 % D_C, 64, dim=1)
        tma.async_copy_global_to_shared(desc, [row, (CH0 + k) * 64], bar, chunk, pred=pred)


@gluon.jit
def _wg0(q_ptr, desc, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr, plse_ptr, T, H, M, MB, NT,
         PER, u0, u1, c, qk_scale, cap, page_size, stride_qb, stride_btb, stride_vb, stride_vi, stride_pb,
         stride_ps, stride_lb, stride_ls, qc_smem, qr_smem, kc_smem, kr_smem, p_smem, a_smem, l_smem,
         full_r, full_0, full_1, p_full, p_empty, l_full, l_empty, cst):  # fmt: skip
    """Warpgroup 0: Q, scores, softmax, P for warpgroup 1, and O's first latent half."""
    D_C: gl.constexpr = cst.D_C
    D_R: gl.constexpr = cst.D_R
    PAGED: gl.constexpr = cst.PAGED
    MASK_MODE: gl.constexpr = cst.MASK_MODE
    HALF: gl.constexpr = D_C // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])  # fmt: skip
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
    cols = gl.arange(0, BN, gl.SliceLayout(0, s_layout))

    g = 0  # tiles this program has started (program-wide: buffer g % 2, phase (g // 2) % 2)
    rb_first = u0 // NT
    rb_last = (u1 - 1) // NT
    count = rb_last - rb_first + 1
    for j in range(count):  # row blocks last first, as in "pipe"
        rb = rb_last - j
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _row_block(rb, u0, u1, MB, NT, seqlens_ptr, T, BN)
        n = gl.maximum(v_end - v_lo, 0)
        for i in gl.static_range(2):  # the first two tiles' groups of this partition
            _issue_group(desc, full_r, kr_smem, g + i, i, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap,
                         page_size, D_C // 64, 1, D_C, PAGED)  # fmt: skip
            _issue_group(desc, full_0, kc_smem, g + i, i, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap,
                         page_size, 0, HALF // 64, D_C, PAGED)  # fmt: skip
        # Q of this row block (rows past M are zeros), 64 columns at a time
        rows_q = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, ld))
        cols_q = gl.arange(0, 64, gl.SliceLayout(0, ld))
        q_rows = q_ptr + b.to(gl.int64) * stride_qb + rows_q.to(gl.int64)[:, None] * (D_C + D_R)
        q_base = q_rows + cols_q[None, :]
        q_ok = (rows_q < M)[:, None] & (cols_q >= 0)[None, :]
        qr_smem.store(gl.load(q_base + D_C, mask=q_ok, other=0.0))
        for k in gl.static_range(D_C // 64):
            qc_smem.slice(k * 64, 64, dim=1).store(gl.load(q_base + k * 64, mask=q_ok, other=0.0))
        fence_async_shared()
        gl.thread_barrier()

        rows = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BM, HALF], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
        for i in range(n):
            v = v_lo + i
            buf = g % 2
            phase = (g // 2) & 1
            if v * BN + BN > seqlen:  # the request's last tile: zero the rows past its end
                mbarrier.wait(full_r.index(buf), phase)
                mbarrier.wait(full_0.index(buf), phase)
                mbarrier.wait(full_1.index(buf), phase)
                _zero_rows(kr_smem.index(buf), v * BN, seqlen, ld)
                _zero_rows(kc_smem.index(buf), v * BN, seqlen, ld)
                fence_async_shared()
                gl.thread_barrier()
            kc_lo = kc_smem.index(buf).slice(0, HALF, dim=1)
            kc_hi = kc_smem.index(buf).slice(HALF, HALF, dim=1)
            mbarrier.wait(full_r.index(buf), phase)
            kr = kr_smem.index(buf)
            s = warpgroup_mma(qr_smem, kr.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(full_0.index(buf), phase)
            s = warpgroup_mma(qc_smem.slice(0, HALF, dim=1), kc_lo.permute((1, 0)), s, is_async=True)
            mbarrier.wait(full_1.index(buf), phase)
            s = warpgroup_mma(qc_smem.slice(HALF, HALF, dim=1), kc_hi.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            gl.thread_barrier()  # every warp is past this tile's scores: its rope buffer is free
            _issue_group(desc, full_r, kr_smem, g + 2, i + 2, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap,
                         page_size, D_C // 64, 1, D_C, PAGED)  # fmt: skip
            if v >= n_free:
                s = _tree_mask(s, vis_ptr, b, rows, v * BN + cols, prefix, seqlen, M, H, stride_vb, stride_vi,
                               MASK_MODE)  # fmt: skip
            s = s * qk_scale
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            mbarrier.wait(p_empty, (g - 1) & 1, pred=g > 0)  # warpgroup 1 is done with the previous P
            p_smem.store(p.to(dtype))
            a_smem.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_full)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            acc = warpgroup_mma(p_smem, kc_lo, acc * alpha_o[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # every warp is done with this tile's first half
            _issue_group(desc, full_0, kc_smem, g + 2, i + 2, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap,
                         page_size, 0, HALF // 64, D_C, PAGED)  # fmt: skip
            g += 1
        # the row sums for warpgroup 1's half of O
        mbarrier.wait(l_empty, (j - 1) & 1, pred=j > 0)
        l_smem.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(l_full)
        if (v_lo == 0) & (v_hi == NT):  # the whole row block: final output
            final, final_lse = _final_ptrs(out_ptr, lse_ptr, b, M, D_C)
            _store_cols(acc, l_i, final, blk, M, 0, D_C, BM, o_layout)
            _store_lse(m_i, l_i, final_lse, blk, M, BM, s_layout)
        else:
            split, split_lse = _slot_ptrs(part_ptr, plse_ptr, b, c, rb, NT, PER, stride_pb, stride_ps,
                                          stride_lb, stride_ls)  # fmt: skip
            _store_cols(acc, l_i, split, blk, M, 0, D_C, BM, o_layout)
            _store_lse(m_i, l_i, split_lse, blk, M, BM, s_layout)


@gluon.jit
def _wg1(q_ptr, desc, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr, plse_ptr, T, H, M, MB, NT,
         PER, u0, u1, c, qk_scale, cap, page_size, stride_qb, stride_btb, stride_vb, stride_vi, stride_pb,
         stride_ps, stride_lb, stride_ls, qc_smem, qr_smem, kc_smem, kr_smem, p_smem, a_smem, l_smem,
         full_r, full_0, full_1, p_full, p_empty, l_full, l_empty, cst):  # fmt: skip
    """Warpgroup 1: O's second latent half from warpgroup 0's P, and its copies of that half."""
    D_C: gl.constexpr = cst.D_C
    PAGED: gl.constexpr = cst.PAGED
    HALF: gl.constexpr = D_C // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])  # fmt: skip

    g = 0
    rb_first = u0 // NT
    rb_last = (u1 - 1) // NT
    count = rb_last - rb_first + 1
    for j in range(count):
        rb = rb_last - j
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _row_block(rb, u0, u1, MB, NT, seqlens_ptr, T, BN)
        n = gl.maximum(v_end - v_lo, 0)
        for i in gl.static_range(2):
            _issue_group(desc, full_1, kc_smem, g + i, i, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap,
                         page_size, HALF // 64, HALF // 64, D_C, PAGED)  # fmt: skip
        acc = gl.zeros([BM, HALF], gl.float32, o_layout)
        for i in range(n):
            buf = g % 2
            mbarrier.wait(p_full, g & 1)
            mbarrier.wait(full_1.index(buf), (g // 2) & 1)
            alpha = a_smem.load(gl.SliceLayout(1, o_layout))
            kc_hi = kc_smem.index(buf).slice(HALF, HALF, dim=1)
            acc = warpgroup_mma(p_smem, kc_hi, acc * alpha[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # every warp is done with P, alpha and this tile's second half
            mbarrier.arrive(p_empty)
            _issue_group(desc, full_1, kc_smem, g + 2, i + 2, n, v_lo, b, seqlen, bt_ptr, stride_btb, cap,
                         page_size, HALF // 64, HALF // 64, D_C, PAGED)  # fmt: skip
            g += 1
        mbarrier.wait(l_full, j & 1)
        l_i = l_smem.load(gl.SliceLayout(1, o_layout))
        gl.thread_barrier()
        mbarrier.arrive(l_empty)
        if (v_lo == 0) & (v_hi == NT):
            final, final_lse = _final_ptrs(out_ptr, lse_ptr, b, M, D_C)
            _store_cols(acc, l_i, final, blk, M, HALF, D_C, BM, o_layout)
        else:
            split, split_lse = _slot_ptrs(part_ptr, plse_ptr, b, c, rb, NT, PER, stride_pb, stride_ps,
                                          stride_lb, stride_ls)  # fmt: skip
            _store_cols(acc, l_i, split, blk, M, HALF, D_C, BM, o_layout)


@gluon.jit
def _roles_kernel(
    q_ptr,  # [b, M, D_C + D_R] (M = t * h rows, row = node * h + head)
    desc,  # TMA descriptor of the cache viewed as [rows, D_C + D_R], boxes of 64 x 64
    seqlens_ptr,
    bt_ptr,
    vis_ptr,
    out_ptr,
    lse_ptr,
    part_ptr,
    plse_ptr,
    T,
    H,
    M,
    MB,
    NT,  # 64-slot tiles per row block in the schedule
    PER,
    n_units,
    qk_scale,
    cap,
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
    D_R: gl.constexpr,
    PAGED: gl.constexpr,
    MASK_MODE: gl.constexpr,
    num_warps: gl.constexpr,  # 4: warpgroup 0; warpgroup 1 is the worker partition
):
    c = gl.program_id(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    u0 = c * PER
    u1 = gl.minimum(u0 + PER, n_units)
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_C], dtype)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qc_smem = gl.allocate_shared_memory(dtype, [BM, D_C], qc_sl)
    qr_smem = gl.allocate_shared_memory(dtype, [BM, D_R], qr_sl)
    kc_smem = gl.allocate_shared_memory(dtype, [2, BN, D_C], qc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [2, BN, D_R], qr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_sl)
    a_smem = gl.allocate_shared_memory(gl.float32, [BM], vec_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [BM], vec_sl)
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    full_0 = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    full_1 = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(2):
        mbarrier.init(full_r.index(k), count=1)
        mbarrier.init(full_0.index(k), count=1)
        mbarrier.init(full_1.index(k), count=1)
    for k in gl.static_range(4):
        mbarrier.init(sync.index(k), count=1)
    args = (q_ptr, desc, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr, plse_ptr, T, H, M, MB, NT,
            PER, u0, u1, c, qk_scale, cap, page_size, stride_qb, stride_btb, stride_vb, stride_vi, stride_pb,
            stride_ps, stride_lb, stride_ls, qc_smem, qr_smem, kc_smem, kr_smem, p_smem, a_smem, l_smem,
            full_r, full_0, full_1, sync.index(0), sync.index(1), sync.index(2), sync.index(3),
            Consts(D_C, D_R, PAGED, MASK_MODE))  # fmt: skip
    gl.warp_specialize([(_wg0, args), (_wg1, args)], [4], [WORKER_REGS])


def launch(q, kv_cache, cache_seqlens, bt, vis, mask_mode, stride_vb, stride_vi, out, lse, part, plse, t, h,
           rows, qk_scale, paged, page_size, programs, per, tiles):  # fmt: skip
    """Runs the "roles" kernel over the schedule (programs, per, tiles) of mla_attention_sm90.schedule
    with 64-row blocks and 64-slot tiles (same cache conditions as "pipe": pipe_applies)."""
    b, d = q.shape[0], q.shape[-1]
    d_c = out.shape[-1]
    blocks = -(-rows // ROWS)
    flat = kv_cache.view(-1, d)
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    box = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    desc = TensorDescriptor(flat, list(flat.shape), [d, 1], [64, 64], box)
    _roles_kernel[(programs,)](
        q, desc, cache_seqlens, bt, vis, out, lse, part, plse,
        t, h, rows, blocks, tiles, per, b * blocks * tiles, qk_scale, kv_cache.shape[1], page_size,
        q.stride(0), bt.stride(0), stride_vb, stride_vi,
        part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, D_R=d - d_c, PAGED=paged, MASK_MODE=mask_mode, num_warps=4,
    )  # fmt: skip
