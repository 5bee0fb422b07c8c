"""Hopper (sm_90) fast path of the tree-verify MLA attention in Gluon.

Why a second kernel: in Triton, a 64-row block with 8 warps makes both warpgroups compute the same
score tile (a chained dot gets warps [8, 1]), 1.53x the useful tensor work (docs/attention.md). Gluon
lets us pick the layouts: one program = 64 query rows (row = node * h + head) x one KV split, two
warpgroups; the score tile S = Q K^T [64, BN] is split by columns between the warpgroups
(warps [4, 2]), P goes through shared memory, and O [64, d_c] is split by columns too (each
warpgroup owns 64 x d_c/2 fp32 accumulators). Every tensor-core product is done once.

Variants (VARIANTS): "pipe" (default for tree masks) and "sched" run the whole tree attention (prefix
and masked tree tiles) in one persistent launch with a balanced schedule over (row block, 128-slot
tile) units, then a log-sum-exp merge of the row blocks the balance cut (kernels/mla_attention.py);
"pipe" copies each tile by TMA in three mbarrier groups refilled as soon as they are consumed, so the
copy overlaps the tensor work; "sched" copies by cp.async (any page size). For causal calls, "wide"
(BN = 128 cache rows per tile in one buffer, the next tile prefetched into the L2) or "double" (BN =
64, two buffers) cover the whole BN tiles inside the prefix, and the rest of each request (the last
partial prefix tile plus the tree slots, masked) runs through the Triton kernel as one more split.
Compiled only on CUDA devices of compute capability 9.x; the Triton kernel serves other GPUs and CI
(the interpreter does not run Gluon).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64
NUM_WARPS = 8  # two warpgroups
SHAPES = ((512, 64),)  # (d_c, d_r) this kernel is built and tested for
NO_LIMIT = gl.constexpr(2**31 - 1)  # _issue_tile's limit where every row asked for exists


@gluon.jit
def _tile_offsets(b, pos, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED: gl.constexpr):
    """int64 element offsets of cache rows `pos` of request b (contiguous or paged cache); multiples of 8
    (16 bytes), which `applies` checks on the strides, so cp.async moves 16-byte vectors."""
    if PAGED:
        page = gl.load(bt_ptr + b * stride_btb + pos // page_size).to(gl.int64)
        off = page * stride_kb + (pos % page_size).to(gl.int64) * stride_ks
    else:
        off = b.to(gl.int64) * stride_kb + pos.to(gl.int64) * stride_ks
    return gl.multiple_of(off, 8)


@gluon.jit
def _issue_tile(kc_buf, kr_buf, kv_ptr, b, first, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size,
                ok, D_C: gl.constexpr, D_R: gl.constexpr, BN: gl.constexpr, PAGED: gl.constexpr,
                LD_C: gl.constexpr, LD_R: gl.constexpr):  # fmt: skip
    """Starts the async copy of cache rows first .. first + BN into (kc_buf, kr_buf); one commit group.
    Rows at or past `limit` (and every row when not ok) are zero-filled, not read: their addresses are
    clamped into rows 0 .. limit - 1, so a paged cache's block table is never read past them."""
    _copy_rows(kc_buf, kv_ptr, b, first, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, ok,
               0, D_C, BN, PAGED, LD_C)  # fmt: skip
    _copy_rows(kr_buf, kv_ptr, b, first, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, ok,
               D_C, D_R, BN, PAGED, LD_R)  # fmt: skip
    cp.commit_group()


@gluon.jit
def _copy_rows(buf, kv_ptr, b, first, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, ok,
               COL0: gl.constexpr, COLS: gl.constexpr, BN: gl.constexpr, PAGED: gl.constexpr,
               LD: gl.constexpr):  # fmt: skip
    pos = first + gl.arange(0, BN, gl.SliceLayout(1, LD))
    valid = (pos < limit) & ok
    pos = gl.maximum(gl.minimum(pos, limit - 1), 0)
    off = _tile_offsets(b, pos, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED)
    cols = COL0 + gl.arange(0, COLS, gl.SliceLayout(0, LD))
    # the mask is per row (the 16-byte vectors stay whole); a masked vector is zero-filled
    cp.async_copy_global_to_shared(buf, kv_ptr + off[:, None] + cols[None, :], mask=valid[:, None])


@gluon.jit
def _split_tiles(seqlens_ptr, b, T, split, num_splits, BN: gl.constexpr):
    """(first tile, tile count) of this split: the whole BN-slot tiles inside request b's prefix, cut
    into num_splits runs of consecutive tiles (a split past the end gets none)."""
    seqlen = gl.load(seqlens_ptr + b).to(gl.int32)
    n_full = (seqlen - T) // BN
    per = gl.cdiv(n_full, num_splits)
    t_lo = split * per
    return t_lo, gl.maximum(gl.minimum(n_full - t_lo, per), 0)


@gluon.jit
def _load_q(q_ptr, b, pid_m, M, stride_qb, D_C: gl.constexpr, D_R: gl.constexpr, BM: gl.constexpr,
            LD_C: gl.constexpr, LD_R: gl.constexpr):  # fmt: skip
    """The BM query rows of block pid_m of request b: (latent part [BM, D_C] in LD_C, rope part
    [BM, D_R] in LD_R); rows past M are zeros."""
    D: gl.constexpr = D_C + D_R
    rows_c = pid_m * BM + gl.arange(0, BM, gl.SliceLayout(1, LD_C))
    cols_c = gl.arange(0, D_C, gl.SliceLayout(0, LD_C))
    q_base = q_ptr + b.to(gl.int64) * stride_qb + rows_c.to(gl.int64)[:, None] * D
    q_c = gl.load(q_base + cols_c[None, :], mask=(rows_c < M)[:, None] & (cols_c >= 0)[None, :], other=0.0)
    rows_r = pid_m * BM + gl.arange(0, BM, gl.SliceLayout(1, LD_R))
    cols_r = gl.arange(0, D_R, gl.SliceLayout(0, LD_R))
    q_r = gl.load(
        q_ptr + b.to(gl.int64) * stride_qb + rows_r.to(gl.int64)[:, None] * D + D_C + cols_r[None, :],
        mask=(rows_r < M)[:, None] & (cols_r >= 0)[None, :],
        other=0.0,
    )
    return q_c, q_r


@gluon.jit
def _online_softmax(s, acc, m_i, l_i, p_smem, qk_scale, o_layout: gl.constexpr):
    """One tile's softmax step: scores s (raw, both warpgroups' column halves; -inf where masked) -> P
    (bf16/fp16) in p_smem, visible to every warp on return; running max m_i and sum l_i updated; acc
    rescaled to the new max, ready for acc += P V. Returns (acc, m_i, l_i, alpha): alpha (in o_layout's
    row slice) rescales any further accumulator of the same rows."""
    s = s * qk_scale
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet (masked)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    return acc * alpha[:, None], m_new, l_i, alpha


@gluon.jit
def _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, blk, M, D_C: gl.constexpr, BM: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    """Writes the normalized output of row block blk (rows blk * BM ..) to o_ptr [M, D_C] (in its
    dtype: float32 split partials or the final output) and the rows' log-sum-exp (natural log; -inf for
    rows that saw no slot, e.g. a split with no tiles) to lse_ptr [M]."""
    _store_cols(acc, l_i, o_ptr, blk, M, 0, D_C, BM, o_layout)
    _store_lse(m_i, l_i, lse_ptr, blk, M, BM, s_layout)


@gluon.jit
def _store_cols(acc, l_i, o_ptr, blk, M, col0, D_C: gl.constexpr, BM: gl.constexpr, o_layout: gl.constexpr):
    """acc [BM, W] / l_i -> columns col0 .. col0 + W of rows blk * BM .. of o_ptr [M, D_C]."""
    W: gl.constexpr = acc.shape[1]
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    rows_o = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, o_layout))
    cols_o = col0 + gl.arange(0, W, gl.SliceLayout(0, o_layout))
    o_ptrs = o_ptr + rows_o.to(gl.int64)[:, None] * D_C + cols_o[None, :]
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows_o < M)[:, None] & (cols_o >= 0)[None, :])


@gluon.jit
def _store_halves(acc0, acc1, m_i, l_i, o_ptr, lse_ptr, blk, M, D_C: gl.constexpr, BM: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    """_store_rows for O held as two accumulators of D_C / 2 columns each."""
    _store_cols(acc0, l_i, o_ptr, blk, M, 0, D_C, BM, o_layout)
    _store_cols(acc1, l_i, o_ptr, blk, M, D_C // 2, D_C, BM, o_layout)
    _store_lse(m_i, l_i, lse_ptr, blk, M, BM, s_layout)


@gluon.jit
def _store_lse(m_i, l_i, lse_ptr, blk, M, BM: gl.constexpr, s_layout: gl.constexpr):
    seen_s = l_i > 0
    lse = gl.where(seen_s, (m_i + gl.log2(gl.where(seen_s, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    rows_s = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + rows_s, lse, mask=rows_s < M)


@gluon.jit
def _prefix_kernel(
    q_ptr,  # [b, M, D_C + D_R] (M = t * h rows, row = node * h + head)
    kv_ptr,
    seqlens_ptr,
    bt_ptr,
    part_ptr,  # [b, splits + 1, M, D_C] float32
    plse_ptr,  # [b, splits + 1, M] float32
    T,
    M,
    num_splits,
    qk_scale,  # softmax scale * log2(e)
    page_size,
    stride_qb,
    stride_kb,
    stride_ks,
    stride_btb,
    stride_pb,
    stride_ps,
    stride_lb,
    stride_ls,
    D_C: gl.constexpr,
    D_R: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    PAGED: gl.constexpr,
    num_warps: gl.constexpr,
):
    pid_m = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    t_lo, n_tiles = _split_tiles(seqlens_ptr, b, T, split, num_splits, BN)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_C // 2, 16]
    )
    ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D_R, D_R // 8], [num_warps, 1], [1, 0])
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_C], dtype)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_R], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_C], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)

    # Query rows of this block, staged in shared memory once.
    q_c, q_r = _load_q(q_ptr, b, pid_m, M, stride_qb, D_C, D_R, BM, ld_c, ld_r)
    qc_smem = gl.allocate_shared_memory(dtype, [BM, D_C], qc_sl, q_c)
    qr_smem = gl.allocate_shared_memory(dtype, [BM, D_R], qr_sl, q_r)
    kc_smem = gl.allocate_shared_memory(dtype, [2, BN, D_C], kc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [2, BN, D_R], kr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_sl)

    acc = gl.zeros([BM, D_C], gl.float32, o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)

    _issue_tile(kc_smem.index(0), kr_smem.index(0), kv_ptr, b, t_lo * BN, NO_LIMIT, bt_ptr, stride_btb,
                stride_kb, stride_ks, page_size, n_tiles > 0, D_C, D_R, BN, PAGED, ld_c, ld_r)  # fmt: skip
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    for i in range(n_tiles):
        # Entering: tile i is in buffer i % 2 and visible to every warp; buffer (i + 1) % 2 is free.
        kc = kc_smem.index(i % 2)
        s = warpgroup_mma(qc_smem, kc.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qr_smem, kr_smem.index(i % 2).permute((1, 0)), s, is_async=True)
        # While the tensor cores compute S, start copying the next tile into the free buffer; it has
        # until the end of this iteration.
        first = (t_lo + i + 1) * BN
        _issue_tile(kc_smem.index((i + 1) % 2), kr_smem.index((i + 1) % 2), kv_ptr, b, first, NO_LIMIT,
                    bt_ptr, stride_btb, stride_kb, stride_ks, page_size, i + 1 < n_tiles, D_C, D_R, BN, PAGED,
                    ld_c, ld_r)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        acc, m_i, l_i, _ = _online_softmax(s, acc, m_i, l_i, p_smem, qk_scale, o_layout)
        acc = warpgroup_mma(p_smem, kc, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)  # this thread's part of tile i + 1 landed
        fence_async_shared()
        gl.thread_barrier()  # every warp: done with p_smem and buffer i % 2; tile i + 1 visible
    cp.wait_group(0)

    o_ptr = part_ptr + b.to(gl.int64) * stride_pb + split.to(gl.int64) * stride_ps
    lse_ptr = plse_ptr + b.to(gl.int64) * stride_lb + split * stride_ls
    _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, pid_m, M, D_C, BM, s_layout, o_layout)


@gluon.jit
def _prefetch_l2(kv_ptr, b, first, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, ok,
                 D: gl.constexpr, BN: gl.constexpr, PAGED: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """Asks the L2 for cache rows first .. first + BN (every 128-byte line), without waiting; rows at or
    past `limit` ask for row limit - 1 instead."""
    LINES: gl.constexpr = 16  # >= ceil(D * 2 / 128); the extra ones repeat the last line
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [num_warps, 1], [1, 0])
    pos = first + gl.arange(0, BN, gl.SliceLayout(1, lay))
    pos = gl.where(ok, pos, first)  # past the run: prefetch this tile again (harmless)
    pos = gl.maximum(gl.minimum(pos, limit - 1), 0)
    off = _tile_offsets(b, pos, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED)
    line = gl.minimum(gl.arange(0, LINES, gl.SliceLayout(0, lay)), (D * 2 - 1) // 128)
    ptrs = kv_ptr + off[:, None] + (line * 64)[None, :]
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _wide_scores(q_r, qc_smem, kc_smem, kr_smem, s_zero, kv_ptr, b, nxt, limit, bt_ptr, stride_btb,
                 stride_kb, stride_ks, page_size, more, D: gl.constexpr, BN: gl.constexpr,
                 PAGED: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One-buffer tile step, first half: waits for the tile's copy (in kc_smem / kr_smem), computes the
    raw scores S = Q_r K_r^T + Q_c K_c^T, and while the tensor cores run asks the L2 for the next
    tile's rows nxt .. nxt + BN (when `more`)."""
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()  # the tile (and Q) visible to every warp
    s = warpgroup_mma(q_r, kr_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(qc_smem, kc_smem.permute((1, 0)), s, is_async=True)
    _prefetch_l2(kv_ptr, b, nxt, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, more, D, BN,
                 PAGED, num_warps)  # fmt: skip
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _wide_accumulate(s, acc, m_i, l_i, p_smem, kc_smem, kr_smem, qk_scale, kv_ptr, b, nxt, limit, bt_ptr,
                     stride_btb, stride_kb, stride_ks, page_size, more, D_C: gl.constexpr, D_R: gl.constexpr,
                     BN: gl.constexpr, PAGED: gl.constexpr, o_layout: gl.constexpr, LD_C: gl.constexpr,
                     LD_R: gl.constexpr):  # fmt: skip
    """One-buffer tile step, second half: online softmax of the (masked) scores s, acc += P V, then
    the copy of the next tile (rows nxt .., limit as in _issue_tile) into the freed buffer.
    Returns (acc, m_i, l_i)."""
    acc, m_i, l_i, _ = _online_softmax(s, acc, m_i, l_i, p_smem, qk_scale, o_layout)
    acc = warpgroup_mma(p_smem, kc_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    gl.thread_barrier()  # every warp is done with the tile and p_smem
    _issue_tile(kc_smem, kr_smem, kv_ptr, b, nxt, limit, bt_ptr, stride_btb, stride_kb, stride_ks, page_size,
                more, D_C, D_R, BN, PAGED, LD_C, LD_R)  # fmt: skip
    return acc, m_i, l_i


@gluon.jit
def _prefix_wide_kernel(
    q_ptr,
    kv_ptr,
    seqlens_ptr,
    bt_ptr,
    part_ptr,
    plse_ptr,
    T,
    M,
    num_splits,
    qk_scale,
    page_size,
    stride_qb,
    stride_kb,
    stride_ks,
    stride_btb,
    stride_pb,
    stride_ps,
    stride_lb,
    stride_ls,
    D_C: gl.constexpr,
    D_R: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    PAGED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The "wide" variant of _prefix_kernel: BN = 128 cache rows per tile in one buffer, so each
    warpgroup's share of S is 64 x 64 (wgmma n = 64 reads Q from shared memory half as often per flop
    as n = 32), the rope part of Q sits in registers, and the next tile is prefetched into the L2 while
    this one is computed (one buffer: its copy starts when this tile's P V is done)."""
    pid_m = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    D: gl.constexpr = D_C + D_R

    t_lo, n_tiles = _split_tiles(seqlens_ptr, b, T, split, num_splits, BN)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_C // 2, 16]
    )
    qr_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D_R, D_R // 8], [num_warps, 1], [1, 0])
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_C], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_C], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)

    q_c, q_r = _load_q(q_ptr, b, pid_m, M, stride_qb, D_C, D_R, BM, ld_c, ld_r)
    q_r = gl.convert_layout(q_r, qr_reg)
    qc_smem = gl.allocate_shared_memory(dtype, [BM, D_C], qc_sl, q_c)
    kc_smem = gl.allocate_shared_memory(dtype, [BN, D_C], kc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [BN, D_R], kr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_sl)

    acc = gl.zeros([BM, D_C], gl.float32, o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)

    _issue_tile(kc_smem, kr_smem, kv_ptr, b, t_lo * BN, NO_LIMIT, bt_ptr, stride_btb, stride_kb, stride_ks,
                page_size, n_tiles > 0, D_C, D_R, BN, PAGED, ld_c, ld_r)  # fmt: skip
    for i in range(n_tiles):
        nxt = (t_lo + i + 1) * BN
        more = i + 1 < n_tiles
        s = _wide_scores(q_r, qc_smem, kc_smem, kr_smem, s_zero, kv_ptr, b, nxt, NO_LIMIT, bt_ptr,
                         stride_btb, stride_kb, stride_ks, page_size, more, D, BN, PAGED,
                         num_warps)  # fmt: skip
        acc, m_i, l_i = _wide_accumulate(s, acc, m_i, l_i, p_smem, kc_smem, kr_smem, qk_scale, kv_ptr, b,
                                         nxt, NO_LIMIT, bt_ptr, stride_btb, stride_kb, stride_ks, page_size,
                                         more, D_C, D_R, BN, PAGED, o_layout, ld_c, ld_r)  # fmt: skip
    cp.wait_group(0)

    o_ptr = part_ptr + b.to(gl.int64) * stride_pb + split.to(gl.int64) * stride_ps
    lse_ptr = plse_ptr + b.to(gl.int64) * stride_lb + split * stride_ls
    _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, pid_m, M, D_C, BM, s_layout, o_layout)


@gluon.jit
def _tree_mask(s, vis_ptr, b, rows, pos, prefix, seqlen, M, H, stride_vb, stride_vi, MASK_MODE: gl.constexpr):
    """Scores s [BM, BN] of a tile that reaches the tree or the end of the request, -inf where not
    visible: slots past seqlen, and tree slots j = pos - prefix that row (node rows // H) does not see
    (visibility [b, t, t] uint8 for MASK_MODE 0, ancestor bits [b, t] int64 for 1)."""
    j = pos - prefix  # [BN]
    node = rows // H  # [BM]
    row_ok = rows < M
    ok = row_ok[:, None] & ((j >= 0) & (pos < seqlen))[None, :]
    if MASK_MODE == 0:
        ptrs = vis_ptr + b.to(gl.int64) * stride_vb + node[:, None] * stride_vi + j[None, :]
        tree = ok & (gl.load(ptrs, mask=ok, other=0) != 0)
    else:
        bits = gl.load(vis_ptr + b.to(gl.int64) * stride_vb + node, mask=row_ok, other=0)
        shift = gl.minimum(gl.maximum(j, 0), 63).to(gl.int64)
        tree = ok & (((bits[:, None] >> shift[None, :]) & 1) != 0)
    return gl.where(tree | (j < 0)[None, :], s, float("-inf"))


@gluon.jit
def _row_block(rb, u0, u1, MB, NT, seqlens_ptr, T, BN: gl.constexpr):
    """Row block rb (of b * MB) of a "sched" / "pipe" program with units u0 .. u1 - 1: (b, blk, v_lo,
    v_hi, v_end, seqlen, prefix, n_free). The program's tiles of it are v_lo .. v_hi - 1, those that
    hold cache slots v_lo .. v_end - 1; tiles below n_free lie wholly inside the prefix (no mask)."""
    b = rb // MB
    blk = rb - b * MB
    v_lo = gl.maximum(u0 - rb * NT, 0)
    v_hi = gl.minimum(u1 - rb * NT, NT)
    seqlen = gl.load(seqlens_ptr + b).to(gl.int32)
    prefix = seqlen - T
    v_end = gl.minimum(v_hi, gl.cdiv(seqlen, BN))
    return b, blk, v_lo, v_hi, v_end, seqlen, prefix, prefix // BN


@gluon.jit
def _final_ptrs(out_ptr, lse_ptr, b, M, D_C: gl.constexpr):
    """Request b's rows of the final output [b, M, D_C] and lse [b, M]."""
    return out_ptr + b.to(gl.int64) * M * D_C, lse_ptr + b.to(gl.int64) * M


@gluon.jit
def _slot_ptrs(part_ptr, plse_ptr, b, c, rb, NT, PER, stride_pb, stride_ps, stride_lb, stride_ls):
    """Program c's float32 partial slot of row block rb (slot c - (rb * NT) // PER: the j-th program to
    meet the row block writes slot j), in part [b, J, M, D_C] and plse [b, J, M]."""
    slot = c - (rb * NT) // PER
    split = part_ptr + b.to(gl.int64) * stride_pb + slot.to(gl.int64) * stride_ps
    return split, plse_ptr + b.to(gl.int64) * stride_lb + slot * stride_ls


@gluon.jit
def _stage_q(q_ptr, b, blk, M, stride_qb, qc_smem, kr_smem, D_C: gl.constexpr, D_R: gl.constexpr,
             BM: gl.constexpr, LD_C: gl.constexpr, LD_R: gl.constexpr, qr_reg: gl.constexpr):  # fmt: skip
    """Row block blk's Q: the latent part into qc_smem, the rope part returned in registers (qr_reg).
    The rope part goes through the (free) rope buffer kr_smem: a convert_layout would take 8 KB of
    scratch shared memory on top of the buffers, more than is left."""
    q_c, q_r = _load_q(q_ptr, b, blk, M, stride_qb, D_C, D_R, BM, LD_C, LD_R)
    gl.thread_barrier()  # every warp is done with the previous row block's Q and tiles
    qc_smem.store(q_c)
    qr_stage = kr_smem.slice(0, BM)
    qr_stage.store(q_r)
    gl.thread_barrier()
    q_r = qr_stage.load(qr_reg)
    gl.thread_barrier()  # every warp has its Q rope part before the first tile's copy lands there
    return q_r


@gluon.jit
def _sched_kernel(
    q_ptr,  # [b, M, D_C + D_R] (M = t * h rows, row = node * h + head)
    kv_ptr,
    seqlens_ptr,
    bt_ptr,
    vis_ptr,  # visibility [b, t, t] uint8 or ancestor bits [b, t] int64 (MASK_MODE 0 / 1)
    out_ptr,  # [b, M, D_C] in q's dtype: row blocks that one program covers whole
    lse_ptr,  # [b, M] float32
    part_ptr,  # [b, J, M, D_C] float32: slot j of a split row block = its j-th program
    plse_ptr,  # [b, J, M] float32
    T,
    H,
    M,
    MB,  # row blocks per request (cdiv(M, BM))
    NT,  # BN-slot tiles per row block in the schedule (cdiv(max seqlen, BN))
    PER,  # tiles per program
    n_units,  # b * MB * NT
    qk_scale,  # softmax scale * log2(e)
    page_size,
    stride_qb,
    stride_kb,
    stride_ks,
    stride_btb,
    stride_vb,
    stride_vi,
    stride_pb,
    stride_ps,
    stride_lb,
    stride_ls,
    D_C: gl.constexpr,
    D_R: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    PAGED: gl.constexpr,
    MASK_MODE: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The "sched" variant: the whole attention of the tree (prefix and masked tree tiles) in one
    persistent launch with a balanced schedule. The work is b * MB * NT units (row block, tile); program
    c takes units c * PER .. c * PER + PER - 1, which may end one row block and start the next, or cut
    one in the middle. A row block covered by one program is written final (out, lse); a cut one writes
    float32 partials, merged by log-sum-exp afterwards (mla_attention._merge_kernel, scheduled mode).
    Tiles of a row block past its request's seqlen are skipped; tiles inside the prefix run unmasked,
    the rest (the last partial prefix tile and the tree) with the tree mask. Per tile the "wide" steps
    (_wide_scores, _wide_accumulate): BN = 128 slots in one buffer, rope part of Q in registers, L2
    prefetch of the next tile."""
    c = gl.program_id(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    D: gl.constexpr = D_C + D_R
    u0 = c * PER
    u1 = gl.minimum(u0 + PER, n_units)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_C // 2, 16]
    )
    qr_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D_R, D_R // 8], [num_warps, 1], [1, 0])
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_C], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_C], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)

    qc_smem = gl.allocate_shared_memory(dtype, [BM, D_C], qc_sl)
    kc_smem = gl.allocate_shared_memory(dtype, [BN, D_C], kc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [BN, D_R], kr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_sl)
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
    cols = gl.arange(0, BN, gl.SliceLayout(0, s_layout))

    rb_first = u0 // NT
    rb_last = (u1 - 1) // NT
    # The row blocks this program's units touch, last first: each program then starts at tile 0 of a
    # row block, and while the programs of one request are all in their first row block they read the
    # same tiles at the same time (one DRAM read, the rest from the L2); in order, program c would
    # start at tile (c * PER) % NT and no two would meet.
    for i in range(rb_last - rb_first + 1):
        rb = rb_last - i
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _row_block(rb, u0, u1, MB, NT, seqlens_ptr, T, BN)

        q_r = _stage_q(q_ptr, b, blk, M, stride_qb, qc_smem, kr_smem, D_C, D_R, BM, ld_c, ld_r, qr_reg)
        rows = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BM, D_C], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))

        _issue_tile(kc_smem, kr_smem, kv_ptr, b, v_lo * BN, seqlen, bt_ptr, stride_btb, stride_kb, stride_ks,
                    page_size, v_lo < v_end, D_C, D_R, BN, PAGED, ld_c, ld_r)  # fmt: skip
        for v in range(v_lo, v_end):
            nxt = (v + 1) * BN
            more = v + 1 < v_end
            s = _wide_scores(q_r, qc_smem, kc_smem, kr_smem, s_zero, kv_ptr, b, nxt, seqlen, bt_ptr,
                             stride_btb, stride_kb, stride_ks, page_size, more, D, BN, PAGED,
                         num_warps)  # fmt: skip
            if v >= n_free:
                s = _tree_mask(s, vis_ptr, b, rows, v * BN + cols, prefix, seqlen, M, H, stride_vb, stride_vi,
                               MASK_MODE)  # fmt: skip
            acc, m_i, l_i = _wide_accumulate(s, acc, m_i, l_i, p_smem, kc_smem, kr_smem, qk_scale, kv_ptr,
                                             b, nxt, seqlen, bt_ptr, stride_btb, stride_kb, stride_ks,
                                             page_size, more, D_C, D_R, BN, PAGED, o_layout, ld_c,
                                             ld_r)  # fmt: skip
        cp.wait_group(0)

        if (v_lo == 0) & (v_hi == NT):  # the whole row block: final output
            final, final_lse = _final_ptrs(out_ptr, lse_ptr, b, M, D_C)
            _store_rows(acc, m_i, l_i, final, final_lse, blk, M, D_C, BM, s_layout, o_layout)
        else:
            split, split_lse = _slot_ptrs(part_ptr, plse_ptr, b, c, rb, NT, PER, stride_pb, stride_ps,
                                          stride_lb, stride_ls)  # fmt: skip
            _store_rows(acc, m_i, l_i, split, split_lse, blk, M, D_C, BM, s_layout, o_layout)


@gluon.jit
def _pipe_row(b, pos, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED: gl.constexpr):
    """Row of the cache viewed as [rows, D] (the TMA descriptor) holding position pos of request b
    (the first of 64 rows in one page); positions past seqlen are clamped to its last 64-row half, so
    a paged cache's block table is never read past the request (those rows are zeroed after landing)."""
    pos = gl.minimum(pos, gl.maximum((seqlen - 1) // 64 * 64, 0))
    if PAGED:
        page = gl.load(bt_ptr + b * stride_btb + pos // page_size)
        return page * page_size + pos % page_size
    return b * cap + pos


@gluon.jit
def _pipe_issue(desc, bar, dst, row0, row1, CH0: gl.constexpr, NCH: gl.constexpr, pred):
    """TMA of cache columns CH0 * 64 .. (CH0 + NCH) * 64 of rows row0 .. + 64 and row1 .. + 64 into dst
    [128, NCH * 64] (rows 0..63 and 64..127); bar completes when all of it has landed."""
    mbarrier.expect(bar, 2 * NCH * 64 * 64 * 2, pred=pred)
    for c in gl.static_range(NCH):
        col = (CH0 + c) * 64
        chunk = dst.slice(c * 64, 64, dim=1)
        tma.async_copy_global_to_shared(desc, [row0, col], bar, chunk.slice(0, 64), pred=pred)
        tma.async_copy_global_to_shared(desc, [row1, col], bar, chunk.slice(64, 64), pred=pred)


@gluon.jit
def _pipe_rows(b, pos, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED: gl.constexpr):
    """(row0, row1): the cache rows (_pipe_row) of the two 64-row halves of the tile at position pos."""
    row0 = _pipe_row(b, pos, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED)
    return row0, _pipe_row(b, pos + 64, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED)


@gluon.jit
def _pipe_tile(desc, bars, g: gl.constexpr, kc_smem, kr_smem, row0, row1, pred, D_C: gl.constexpr):
    """Starts group g of the 128-row tile whose halves are cache rows row0 .. and row1 .. (_pipe_rows):
    0 the rope columns, 1 the first half of the latent columns, 2 the second half."""
    HALF: gl.constexpr = D_C // 2
    if g == 0:
        _pipe_issue(desc, bars.index(0), kr_smem, row0, row1, D_C // 64, 1, pred)
    elif g == 1:
        _pipe_issue(desc, bars.index(1), kc_smem.slice(0, HALF, dim=1), row0, row1, 0, HALF // 64, pred)
    else:
        _pipe_issue(desc, bars.index(2), kc_smem.slice(HALF, HALF, dim=1), row0, row1, HALF // 64, HALF // 64,
                    pred)  # fmt: skip


@gluon.jit
def _zero_rows(buf, first, limit, LD: gl.constexpr):
    """Zeroes the rows of buf [128, W] whose cache position first + r is at or past limit (64 columns
    at a time), so that 0 * (NaN or Inf of an unused slot) cannot reach P V."""
    for c in gl.static_range(buf.shape[1] // 64):
        chunk = buf.slice(c * 64, 64, dim=1)
        x = chunk.load(LD)
        r = first + gl.arange(0, buf.shape[0], gl.SliceLayout(1, LD))
        chunk.store(gl.where((r < limit)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _pipe_kernel(
    q_ptr,
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
    NT,
    PER,
    n_units,
    qk_scale,
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
    D_R: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    PAGED: gl.constexpr,
    MASK_MODE: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The "pipe" variant: the schedule of _sched_kernel (same units, same final / partial outputs),
    with the tile copied by TMA in three groups, each refilled for the next tile as soon as this
    one is done with it, so the copy overlaps the tensor work: the rope columns (group 0) after the
    scores, the first half of the latent columns (group 1) after the first half of P V, the second
    half (group 2) after the second. The scores wait for each group in turn, so they start on the
    first groups while the last is still landing. O is two accumulators of D_C / 2 columns (one per
    latent half, each split by columns between the warpgroups). Needs a cache whose 64-row halves of
    a tile are contiguous rows (a contiguous cache, or pages of a multiple of 64 rows)."""
    c = gl.program_id(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = D_C // 2
    u0 = c * PER
    u1 = gl.minimum(u0 + PER, n_units)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HALF // 2, 16]
    )
    qr_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D_R, D_R // 8], [num_warps, 1], [1, 0])
    ld_z: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D_C], dtype)
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_C], dtype)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D_R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)

    qc_smem = gl.allocate_shared_memory(dtype, [BM, D_C], qc_sl)
    kc_smem = gl.allocate_shared_memory(dtype, [BN, D_C], kc_sl)
    kr_smem = gl.allocate_shared_memory(dtype, [BN, D_R], kr_sl)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_sl)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for g in gl.static_range(3):
        mbarrier.init(bars.index(g), count=1)
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
    cols = gl.arange(0, BN, gl.SliceLayout(0, s_layout))

    it = 0  # tiles this program has waited for: the barriers' phase is it % 2
    rb_first = u0 // NT
    rb_last = (u1 - 1) // NT
    for i in range(rb_last - rb_first + 1):  # row blocks last first, as in _sched_kernel
        rb = rb_last - i
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _row_block(rb, u0, u1, MB, NT, seqlens_ptr, T, BN)

        q_r = _stage_q(q_ptr, b, blk, M, stride_qb, qc_smem, kr_smem, D_C, D_R, BM, ld_c, ld_r, qr_reg)
        rows = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
        acc0 = gl.zeros([BM, HALF], gl.float32, o_layout)
        acc1 = gl.zeros([BM, HALF], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))

        fence_async_shared()  # the rope buffer's Q staging (generic proxy) before the TMA writes there
        row0, row1 = _pipe_rows(b, v_lo * BN, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED)
        for g in gl.static_range(3):
            _pipe_tile(desc, bars, g, kc_smem, kr_smem, row0, row1, v_lo < v_end, D_C)
        for v in range(v_lo, v_end):
            phase = it & 1
            nxt = (v + 1) * BN
            more = v + 1 < v_end
            if v * BN + BN > seqlen:  # the request's last tile: zero the rows past its end
                for g in gl.static_range(3):
                    mbarrier.wait(bars.index(g), phase)
                _zero_rows(kr_smem, v * BN, seqlen, ld_z)
                _zero_rows(kc_smem, v * BN, seqlen, ld_z)
                fence_async_shared()
                gl.thread_barrier()
            mbarrier.wait(bars.index(0), phase)
            s = warpgroup_mma(q_r, kr_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(bars.index(1), phase)
            s = warpgroup_mma(qc_smem.slice(0, HALF, dim=1), kc_smem.slice(0, HALF, dim=1).permute((1, 0)), s,
                              is_async=True)  # fmt: skip
            mbarrier.wait(bars.index(2), phase)
            kc_hi = kc_smem.slice(HALF, HALF, dim=1)
            s = warpgroup_mma(qc_smem.slice(HALF, HALF, dim=1), kc_hi.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            it += 1
            if v >= n_free:
                s = _tree_mask(s, vis_ptr, b, rows, v * BN + cols, prefix, seqlen, M, H, stride_vb, stride_vi,
                               MASK_MODE)  # fmt: skip
            # (the softmax ends with a barrier: every warp is past its scores, the rope buffer is free)
            acc0, m_i, l_i, alpha = _online_softmax(s, acc0, m_i, l_i, p_smem, qk_scale, o_layout)
            acc1 = acc1 * alpha[:, None]
            # the next tile's cache rows (a paged cache's block table read once for its three groups)
            row0, row1 = _pipe_rows(b, nxt, seqlen, bt_ptr, stride_btb, cap, page_size, PAGED)
            _pipe_tile(desc, bars, 0, kc_smem, kr_smem, row0, row1, more, D_C)
            acc0 = warpgroup_mma(p_smem, kc_smem.slice(0, HALF, dim=1), acc0, is_async=True)
            acc1 = warpgroup_mma(p_smem, kc_smem.slice(HALF, HALF, dim=1), acc1, is_async=True)
            acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0,))
            gl.thread_barrier()  # every warp is done with the first latent half
            _pipe_tile(desc, bars, 1, kc_smem, kr_smem, row0, row1, more, D_C)
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
            gl.thread_barrier()  # and with the second (and with p_smem)
            _pipe_tile(desc, bars, 2, kc_smem, kr_smem, row0, row1, more, D_C)

        if (v_lo == 0) & (v_hi == NT):  # the whole row block: final output
            final, final_lse = _final_ptrs(out_ptr, lse_ptr, b, M, D_C)
            _store_halves(acc0, acc1, m_i, l_i, final, final_lse, blk, M, D_C, BM, s_layout, o_layout)
        else:
            split, split_lse = _slot_ptrs(part_ptr, plse_ptr, b, c, rb, NT, PER, stride_pb, stride_ps,
                                          stride_lb, stride_ls)  # fmt: skip
            _store_halves(acc0, acc1, m_i, l_i, split, split_lse, blk, M, D_C, BM, s_layout, o_layout)
    for g in gl.static_range(3):
        mbarrier.invalidate(bars.index(g))


@functools.lru_cache(maxsize=16)
def supported_device(device_index: int) -> bool:
    """True on CUDA devices of compute capability 9.x (wgmma); the Gluon kernel is built for sm_90a."""
    if device_index < 0 or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


def applies(q: torch.Tensor, d_v: int) -> bool:
    """Whether the sm_90 kernels can serve this call: bf16/fp16 on Hopper, d_c + d_r in SHAPES."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.is_cuda:
        return False
    return (d_v, q.shape[-1] - d_v) in SHAPES and supported_device(q.get_device())


# name -> (kernel, cache rows per tile); "roles" (default, kernels/mla_attention_roles.py): the whole
# tree attention in one balanced persistent launch, warpgroup 0 on the scores and softmax, warpgroup 1
# on half of P V (the tree mask inside; causal calls take "wide"; contiguous caches or pages of a
# multiple of 64 rows, else "sched"); "pipe": the same schedule with both warpgroups on every step,
# 128-slot tiles by TMA overlapped with the tensor work; "sched": as "pipe" with cp.async copies, not
# overlapped; "double": 64-row tiles, two buffers (the next tile's copy overlaps this one); "wide":
# 128-row tiles, one buffer, L2 prefetch of the next tile. "double" and "wide" cover the whole prefix
# tiles only (launch_prefix). "roles" lives in its own module (which imports this one's helpers).
VARIANTS = {
    "sched": (_sched_kernel, 128),
    "pipe": (_pipe_kernel, 128),
    "double": (_prefix_kernel, 64),
    "wide": (_prefix_wide_kernel, 128),
}
DEFAULT_VARIANT = "roles"
ROLES_TILE = 64  # cache rows per tile of "roles"
MIN_TILES = 4  # a program's least share of a long request (its Q load and partial store amortized)
ALIGN_SLACK = 0.1  # schedule: the most balance an aligned cut may cost (-1: never align)


def tile_rows(variant: str | None = None) -> int:
    name = variant or DEFAULT_VARIANT
    return ROLES_TILE if name == "roles" else VARIANTS[name][1]


def schedule(b: int, blocks: int, tiles: int, sms: int, num_splits: int | None = None) -> tuple[int, ...]:
    """The "sched" launch: (programs, tiles per program, partial slots per row block; 0 when no row
    block is cut, so no merge; tiles per row block in the launch, >= tiles). b * blocks row blocks of
    `tiles` tiles each are dealt out evenly over `sms` programs (one per multiprocessor: a program uses
    nearly all its shared memory); when each program gets 4 row blocks or more, it gets whole ones
    (imbalance <= 1/4, no partials). A request of several row blocks, each cut, has them cut at the
    same tiles when that costs at most ALIGN_SLACK of balance (aligned): the programs of one run then
    read the same cache tiles at about the same time, from the L2 after the first, instead of reading
    the request's cache once per row block from memory (h = 8, t = 9: 2 row blocks). Its row blocks are
    padded to a whole number of runs (tiles past a request's end are no work).
    num_splits (tests): each row block cut into that many runs of tiles instead."""
    units = b * blocks * tiles
    if num_splits:
        per = -(-tiles // num_splits)
    else:
        per = max(-(-units // max(sms, 1)), min(tiles, MIN_TILES))
        if per >= 4 * tiles:
            per = -(-per // tiles) * tiles
        runs = sms // (b * blocks) if blocks > 1 and per < tiles else 0
        if runs >= 1:
            aligned = max(-(-tiles // runs), min(tiles, MIN_TILES))
            if aligned <= per * (1 + ALIGN_SLACK):
                runs = -(-tiles // aligned)
                padded = runs * aligned
                return b * blocks * runs, aligned, runs if runs > 1 else 0, padded
    slots = 0 if per % tiles == 0 else (tiles - 1) // per + 2  # most programs one row block meets
    return -(-units // per), per, slots, tiles


def launch_sched(q, kv_cache, cache_seqlens, bt, vis, mask_mode, stride_vb, stride_vi, out, lse, part, plse,
                 t, h, rows, qk_scale, paged, page_size, programs, per, tiles):  # fmt: skip
    """Runs the "sched" kernel: out / lse for the row blocks one program covers, part / plse slots for
    the cut ones (then mla_attention._merge in scheduled mode)."""
    b, d = q.shape[0], q.shape[-1]
    d_c = out.shape[-1]
    blocks = -(-rows // BLOCK_M)
    _sched_kernel[(programs,)](
        q, kv_cache, cache_seqlens, bt, vis, out, lse, part, plse,
        t, h, rows, blocks, tiles, per, b * blocks * tiles, qk_scale, page_size,
        q.stride(0), kv_cache.stride(0), kv_cache.stride(1), bt.stride(0), stride_vb, stride_vi,
        part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, D_R=d - d_c, BM=BLOCK_M, BN=VARIANTS["sched"][1], PAGED=paged, MASK_MODE=mask_mode,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def pipe_applies(kv_cache: torch.Tensor, paged: bool) -> bool:
    """The "pipe" kernel reads the cache by TMA as one [rows, d] matrix in 64-row boxes: the cache must
    be contiguous, and a paged cache's pages a multiple of 64 rows."""
    return kv_cache.is_contiguous() and (not paged or kv_cache.shape[1] % 64 == 0)


def cache_desc(kv_cache: torch.Tensor) -> TensorDescriptor:
    """TMA descriptor of the cache (bf16 or fp16) viewed as one [rows, d] matrix, in 64 x 64 boxes
    ("pipe" and "roles"; pipe_applies says when the view is valid)."""
    d = kv_cache.shape[-1]
    flat = kv_cache.view(-1, d)
    dtype = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    box = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    return TensorDescriptor(flat, list(flat.shape), [d, 1], [64, 64], box)


def launch_pipe(q, kv_cache, cache_seqlens, bt, vis, mask_mode, stride_vb, stride_vi, out, lse, part, plse,
                t, h, rows, qk_scale, paged, page_size, programs, per, tiles):  # fmt: skip
    """Runs the "pipe" kernel (the "sched" schedule and outputs; see pipe_applies)."""
    b, d = q.shape[0], q.shape[-1]
    d_c = out.shape[-1]
    blocks = -(-rows // BLOCK_M)
    _pipe_kernel[(programs,)](
        q, cache_desc(kv_cache), cache_seqlens, bt, vis, out, lse, part, plse,
        t, h, rows, blocks, tiles, per, b * blocks * tiles, qk_scale, kv_cache.shape[1], page_size,
        q.stride(0), bt.stride(0), stride_vb, stride_vi,
        part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, D_R=d - d_c, BM=BLOCK_M, BN=VARIANTS["pipe"][1], PAGED=paged, MASK_MODE=mask_mode,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def launch_prefix(
    q, kv_cache, cache_seqlens, bt, part, plse, t, rows, num_splits, qk_scale, paged, page_size, variant=None
):
    """Runs the "double" or "wide" prefix kernel into splits 0 .. num_splits - 1 of (part, plse)."""
    kernel, block_n = VARIANTS[variant or "wide"]
    b, d = q.shape[0], q.shape[-1]
    d_c = part.shape[-1]
    grid = (-(-rows // BLOCK_M), num_splits, b)
    kernel[grid](
        q, kv_cache, cache_seqlens, bt, part, plse,
        t, rows, num_splits, qk_scale, page_size,
        q.stride(0), kv_cache.stride(0), kv_cache.stride(1), bt.stride(0),
        part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, D_R=d - d_c, BM=BLOCK_M, BN=block_n, PAGED=paged, num_warps=NUM_WARPS,
    )  # fmt: skip
