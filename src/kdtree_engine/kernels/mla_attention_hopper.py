"""Tree-verify MLA attention for Hopper (sm_90) in Gluon: warpgroups with roles, TMA copies, and a
balanced persistent schedule.

One program per multiprocessor walks its units of the schedule (kernels/mla_attention_schedule.py:
(row block, tile) units, 64 query rows x 64 cache slots, row blocks numbered plane by plane, read from
the device; a request's row blocks aligned on programs that run at the same time). Per row block it
computes the whole attention of those rows over its tiles: tiles inside the prefix without a mask,
the rest with the tree mask (visibility, ancestor bits or causal) and with the slots past the
request's length zeroed. A row block covered by one program is written final; a cut one is written
as float32 pieces (slot 2c for program c's first row block, 2c + 1 for its last) and merged by
log-sum-exp afterwards (kernels/mla_attention_merge.py).

The two warpgroups have roles (gl.warp_specialize), as in FlashMLA:
- warpgroup 0 stages Q, computes the whole score tile S = Q K^T [64, 64] (a row never leaves its
  warp, so the softmax needs no shared memory), runs the online softmax, hands P and the rescale
  factors to warpgroup 1 through shared memory, and accumulates the first half of O (latent columns
  0 .. d_c / 2);
- warpgroup 1 accumulates the second half of O from the same P, so its tensor work on tile i
  overlaps warpgroup 0's scores and softmax of tile i + 1.
A tile is three copy groups (rope columns, first and second latent half), each in two buffers with
its own mbarriers, refilled two tiles ahead by the warpgroup that frees it. A cache that TMA can read
in 64-row boxes (contiguous, or pages of a multiple of 64 rows) is copied by TMA; any other page size
(SGLang's token pool has pages of one row) is gathered: the freeing warpgroup's 128 threads look the
tile's rows up in the block table one tile ahead of the copy and move them with cp.async, each thread
arriving on the group's mbarrier when its copies have landed.
"""

import functools
from dataclasses import dataclass

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
from triton.language.core import _aggregate as aggregate

from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels import mla_attention_schedule as schedule
from kdtree_engine.kernels._device import device_multiprocessors
from kdtree_engine.kernels.mla_attention_args import MASK_CAUSAL, MASK_VISIBILITY, LaunchBounds, Problem
from kdtree_engine.kernels.mla_attention_merge import merge_pieces
from kdtree_engine.kernels.mla_attention_schedule import Schedule

BLOCK_M = 64  # query rows per row block
TILE = 64  # cache slots per tile
MIN_ROWS = 17  # fewer rows per request on a contiguous cache: the Triton kernel's 16-row blocks are faster
SHAPES = ((512, 64),)  # (d_c, d_r) the kernel is built and tested for
CAUSAL = gl.constexpr(MASK_CAUSAL)
VISIBILITY = gl.constexpr(MASK_VISIBILITY)
BM = gl.constexpr(BLOCK_M)
BN = gl.constexpr(TILE)
GATHER_LD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # a gathered 64 x 64 chunk
WARPGROUP = gl.constexpr(128)  # threads per warpgroup: the arrivals a gathered group's mbarrier counts
WORKER_REGS = gl.constexpr(192)  # warpgroup 1's registers per thread (O half: 128); warpgroup 0 gets the rest


@functools.lru_cache(maxsize=16)
def supported_device(device_index: int) -> bool:
    """True on CUDA devices of compute capability 9.x (wgmma, TMA); the kernel is built for sm_90a."""
    if device_index < 0 or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


def gathers(kv_cache: torch.Tensor, paged: bool) -> bool:
    """Whether the kernel gathers the cache's rows (cp.async through the block table, row by row)
    instead of copying 64-row boxes by TMA: a paged cache whose pages are not a multiple of 64 rows."""
    return paged and kv_cache.shape[1] % 64 != 0


def serves(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int, paged: bool) -> bool:
    """Whether this kernel can run the call: Hopper, bf16/fp16, (d_c, d_r) in SHAPES, 16-byte aligned q
    and a contiguous 16-byte aligned cache, and at least MIN_ROWS query rows per request unless the
    cache's pages are a multiple of 64 rows: on pages of 64 this kernel, one 64-row block for the few
    rows, beat every Triton decode launch timed at h = 8, t = 1 (docs/notes/kernels.md); decode on a
    gathered cache (pages of 1, ...) stays with the Triton kernel until it is timed."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.is_cuda:
        return False
    few_rows = q.shape[1] * q.shape[2] < MIN_ROWS
    if (d_v, q.shape[-1] - d_v) not in SHAPES or (few_rows and (not paged or gathers(kv_cache, paged))):
        return False
    aligned = kv_cache.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0
    return aligned and kv_cache.is_contiguous() and supported_device(q.get_device())


def cache_desc(kv_cache: torch.Tensor) -> TensorDescriptor:
    """TMA descriptor of the cache (bf16 or fp16) viewed as one [rows, d] matrix, in 64 x 64 boxes."""
    d = kv_cache.shape[-1]
    flat = kv_cache.view(-1, d)
    dtype = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    box = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    return TensorDescriptor(flat, list(flat.shape), [d, 1], [64, 64], box)


@aggregate
class Consts:
    """The kernel's compile-time parameters, as the partitions receive them (gl.warp_specialize passes
    plain constexpr arguments on as runtime values)."""

    D_C: gl.constexpr
    D_R: gl.constexpr
    PAGED: gl.constexpr
    MASK_MODE: gl.constexpr
    GATHER: gl.constexpr  # copy the tiles row by row through the block table (cp.async), not by TMA

    @gluon.constexpr_function
    def __init__(self, D_C, D_R, PAGED, MASK_MODE, GATHER):
        self.D_C = gl.constexpr(D_C)
        self.D_R = gl.constexpr(D_R)
        self.PAGED = gl.constexpr(PAGED)
        self.MASK_MODE = gl.constexpr(MASK_MODE)
        self.GATHER = gl.constexpr(GATHER)


@aggregate
class Job:
    """The launch's pointers, sizes and strides as both partitions get them, plus the schedule (NT
    tiles per row block, this program's units u0 .. u1 - 1) and the program's index c."""

    q_ptr: gl.tensor
    desc: tma.tensor_descriptor
    kv_ptr: gl.tensor  # the same cache, for the gathered copies
    seqlens_ptr: gl.tensor
    bt_ptr: gl.tensor
    vis_ptr: gl.tensor
    out_ptr: gl.tensor
    lse_ptr: gl.tensor
    part_ptr: gl.tensor
    plse_ptr: gl.tensor
    T: gl.tensor
    H: gl.tensor
    M: gl.tensor
    B: gl.tensor
    NT: gl.tensor
    u0: gl.tensor
    u1: gl.tensor
    c: gl.tensor
    qk_scale: gl.tensor
    cap: gl.tensor
    page_size: gl.tensor
    stride_qb: gl.tensor
    stride_btb: gl.tensor
    stride_vb: gl.tensor
    stride_vi: gl.tensor

    @gluon.constexpr_function
    def __init__(self, q_ptr, desc, kv_ptr, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr,
                 plse_ptr, T, H, M, B, NT, u0, u1, c, qk_scale, cap, page_size, stride_qb, stride_btb,
                 stride_vb, stride_vi):  # fmt: skip
        for name, value in list(locals().items()):
            if name != "self":
                setattr(self, name, value)


@aggregate
class Smem:
    """The shared-memory buffers and mbarriers both partitions use."""

    qc_smem: gl.shared_memory_descriptor  # Q's latent part [64, D_C]
    qr_smem: gl.shared_memory_descriptor  # Q's rope part [64, D_R]
    kc_smem: gl.shared_memory_descriptor  # the tile's latent part, two buffers [2, 64, D_C]
    kr_smem: gl.shared_memory_descriptor  # the tile's rope part, two buffers [2, 64, D_R]
    p_smem: gl.shared_memory_descriptor  # P [64, 64] from warpgroup 0
    a_smem: gl.shared_memory_descriptor  # the rescale factors [64] of that P
    l_smem: gl.shared_memory_descriptor  # a finished row block's row sums [64]
    full_r: gl.shared_memory_descriptor  # TMA landed: rope group, per buffer
    full_0: gl.shared_memory_descriptor  # first latent half
    full_1: gl.shared_memory_descriptor  # second latent half
    p_full: gl.shared_memory_descriptor  # P and alpha written (warpgroup 0 -> 1)
    p_empty: gl.shared_memory_descriptor  # P and alpha read (warpgroup 1 -> 0)
    l_full: gl.shared_memory_descriptor  # row sums written
    l_empty: gl.shared_memory_descriptor  # row sums read

    @gluon.constexpr_function
    def __init__(self, qc_smem, qr_smem, kc_smem, kr_smem, p_smem, a_smem, l_smem, full_r, full_0, full_1,
                 p_full, p_empty, l_full, l_empty):  # fmt: skip
        for name, value in list(locals().items()):
            if name != "self":
                setattr(self, name, value)


@gluon.jit
def _row_blocks(job):
    """(first, count): this program's row blocks are first + count - 1 down to first (none when the
    program has no units)."""
    first = job.u0 // job.NT
    count = (job.u1 - 1) // job.NT - first + 1
    return first, gl.where(job.u0 < job.u1, count, 0)


@gluon.jit
def _block(job, rb):
    """Row block rb of this program: (b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free). Its tiles
    in this program are v_lo .. v_hi - 1, those holding slots a row may see v_lo .. v_end - 1; tiles
    below n_free lie wholly inside the prefix (no mask). No row sees past its block's last node (causal, and
    a tree's nodes come ancestors first: plan_attention's contract), so its tiles stop there."""
    blk = rb // job.B  # plane-major: row block blk of request b
    b = rb - blk * job.B
    v_lo = gl.maximum(job.u0 - rb * job.NT, 0)
    v_hi = gl.minimum(job.u1 - rb * job.NT, job.NT)
    seqlen = gl.load(job.seqlens_ptr + b).to(gl.int32)
    prefix = seqlen - job.T
    seen = prefix + gl.minimum((blk * BM + BM - 1) // job.H, job.T - 1) + 1
    v_end = gl.minimum(v_hi, gl.cdiv(seen, BN))
    return b, blk, v_lo, v_hi, v_end, seqlen, prefix, prefix // BN


@gluon.jit
def _store_block(job, acc, m_i, l_i, b, blk, rb, v_lo, v_hi, col0, D_C: gl.constexpr, o_layout: gl.constexpr,
                 s_layout: gl.constexpr, WITH_LSE: gl.constexpr):  # fmt: skip
    """Row block rb's columns col0 .. of O (and its lse, WITH_LSE): final when this program covers the
    whole block, else as a float32 piece in slot 2c (the program's first row block) or 2c + 1 (its
    last), addressed so that piece row r holds block row blk * BM + r."""
    if (v_lo == 0) & (v_hi == job.NT):
        o_ptr = job.out_ptr + b.to(gl.int64) * job.M * D_C
        _store_cols(acc, l_i, o_ptr, blk, job.M, col0, D_C, o_layout)
        if WITH_LSE:
            _store_lse(m_i, l_i, job.lse_ptr + b.to(gl.int64) * job.M, blk, job.M, s_layout)
    else:
        slot = 2 * job.c + (rb != job.u0 // job.NT).to(gl.int32)
        shift = (slot - blk).to(gl.int64) * BM
        _store_cols(acc, l_i, job.part_ptr + shift * D_C, blk, job.M, col0, D_C, o_layout)
        if WITH_LSE:
            _store_lse(m_i, l_i, job.plse_ptr + shift, blk, job.M, s_layout)


@gluon.jit
def _row_bits(job, b, rows, MASK_MODE: gl.constexpr):
    """The ancestor bits of query rows `rows` of request b (one int64 per row: its node's), loaded once
    per row block, before its tiles, so that no tile waits for them; 0 in the other mask modes."""
    if MASK_MODE == CAUSAL or MASK_MODE == VISIBILITY:
        return gl.zeros_like(rows).to(gl.int64)
    else:
        node = rows // job.H
        return gl.load(job.vis_ptr + b.to(gl.int64) * job.stride_vb + node, mask=rows < job.M, other=0)


@gluon.jit
def _tree_mask(s, job, b, rows, bits, pos, prefix, seqlen, MASK_MODE: gl.constexpr):
    """Scores s [BM, BN] of a tile that reaches the tree or the end of the request, -inf where not
    visible: slots past seqlen, and tree slots j = pos - prefix that row (node rows // H) does not see.
    bits: the rows' ancestor bits (_row_bits) in that mask mode."""
    j = pos - prefix  # [BN]
    node = rows // job.H  # [BM]
    row_ok = rows < job.M
    ok = row_ok[:, None] & ((j >= 0) & (pos < seqlen))[None, :]
    if MASK_MODE == VISIBILITY:
        ptrs = job.vis_ptr + b.to(gl.int64) * job.stride_vb + node[:, None] * job.stride_vi + j[None, :]
        tree = ok & (gl.load(ptrs, mask=ok, other=0) != 0)
    elif MASK_MODE == CAUSAL:
        tree = ok & (j[None, :] <= node[:, None])
    else:
        shift = gl.minimum(gl.maximum(j, 0), 63).to(gl.int64)
        tree = ok & (((bits[:, None] >> shift[None, :]) & 1) != 0)
    return gl.where(tree | (j < 0)[None, :], s, float("-inf"))


@gluon.jit
def _cache_row(job, b, pos, seqlen, PAGED: gl.constexpr):
    """Row of the cache viewed as [rows, D] (the TMA descriptor) holding position pos of request b
    (the first of 64 rows in one page); positions past seqlen are clamped to its last 64-row tile, so
    a paged cache's block table is never read past the request (those rows are zeroed after landing)."""
    pos = gl.minimum(pos, gl.maximum((seqlen - 1) // 64 * 64, 0))
    if PAGED:
        page = gl.load(job.bt_ptr + b * job.stride_btb + pos // job.page_size)
        return page * job.page_size + pos % job.page_size
    return b * job.cap + pos


@gluon.jit
def _zero_rows(buf, first, limit, LD: gl.constexpr):
    """Zeroes the rows of buf [BN, W] whose cache position first + r is at or past limit (64 columns
    at a time), so that 0 * (NaN or Inf of an unused slot) cannot reach P V."""
    for c in gl.static_range(buf.shape[1] // 64):
        chunk = buf.slice(c * 64, 64, dim=1)
        x = chunk.load(LD)
        r = first + gl.arange(0, buf.shape[0], gl.SliceLayout(1, LD))
        chunk.store(gl.where((r < limit)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _store_cols(acc, l_i, o_ptr, blk, M, col0, D_C: gl.constexpr, o_layout: gl.constexpr):
    """acc [BM, W] / l_i -> columns col0 .. col0 + W of rows blk * BM .. of o_ptr [M, D_C]."""
    W: gl.constexpr = acc.shape[1]
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    rows_o = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, o_layout))
    cols_o = col0 + gl.arange(0, W, gl.SliceLayout(0, o_layout))
    o_ptrs = o_ptr + rows_o.to(gl.int64)[:, None] * D_C + cols_o[None, :]
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows_o < M)[:, None] & (cols_o >= 0)[None, :])


@gluon.jit
def _store_lse(m_i, l_i, lse_ptr, blk, M, s_layout: gl.constexpr):
    """The rows' log-sum-exp (natural log; -inf for rows that saw no slot)."""
    seen = l_i > 0
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    rows_s = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + rows_s, lse, mask=rows_s < M)


@gluon.jit
def _issue_group(job, cst, bars, bufs, g, i, n, v_lo, b, seqlen, rows, valid, CH0: gl.constexpr,
                 NCH: gl.constexpr):  # fmt: skip
    """Copy of one group of the row block's local tile i (program tile g), if the block has that tile
    (i < n): cache columns CH0 * 64 .. (CH0 + NCH) * 64 of the tile's 64 rows into the same columns of
    buffer g % 2 of bufs (the rope buffers take CH0 = D_C / 64 into their columns 0 ..); bar g % 2
    completes when the group has landed. By TMA, or gathered from the cache rows `rows` (valid: below
    the request's length; _gather_rows of the tile) when cst.GATHER."""
    D_C: gl.constexpr = cst.D_C
    bar = bars.index(g % 2)
    dst = bufs.index(g % 2)
    if cst.GATHER:
        if i < n:
            _gather_group(job, bar, dst, rows, valid, CH0, NCH, D_C, D_C + cst.D_R)
    else:
        row = _cache_row(job, b, (v_lo + i) * BN, seqlen, cst.PAGED)
        pred = i < n
        mbarrier.expect(bar, NCH * 64 * 64 * 2, pred=pred)
        for k in gl.static_range(NCH):
            chunk = dst.slice((CH0 + k) * 64 % D_C, 64, dim=1)
            tma.async_copy_global_to_shared(job.desc, [row, (CH0 + k) * 64], bar, chunk, pred=pred)


@gluon.jit
def _gather_rows(job, b, first, seqlen, GATHER: gl.constexpr):
    """(rows, valid) of cache positions first .. first + BN of request b when GATHER (else placeholders):
    the int64 rows of the cache viewed as [rows, D] through the block table, and which positions lie
    below seqlen. Positions past it are clamped to its last, so the table is never read past the
    request; their copies are zero-filled. Looked up a tile ahead, so the table's latency hides behind
    the tensor work."""
    if GATHER:
        pos = first + gl.arange(0, BN, gl.SliceLayout(1, GATHER_LD))
        valid = pos < seqlen
        pos = gl.minimum(pos, gl.maximum(seqlen - 1, 0))
        page = gl.load(job.bt_ptr + b * job.stride_btb + pos // job.page_size)
        return page.to(gl.int64) * job.page_size + pos % job.page_size, valid
    else:
        return 0, 0


@gluon.jit
def _gather_group(job, bar, dst, rows, valid, CH0: gl.constexpr, NCH: gl.constexpr, D_C: gl.constexpr,
                  D: gl.constexpr):  # fmt: skip
    """cp.async of cache columns CH0 * 64 .. (CH0 + NCH) * 64 of rows `rows` into dst (as _issue_group),
    16 bytes per copy, rows not valid zero-filled; then each of the warpgroup's threads arrives on bar
    once its copies have landed (the barrier counts WARPGROUP arrivals)."""
    cols = gl.arange(0, 64, gl.SliceLayout(0, GATHER_LD))
    base = job.kv_ptr + rows[:, None] * D  # D a multiple of 8: the copies move whole 16-byte vectors
    for k in gl.static_range(NCH):
        chunk = dst.slice((CH0 + k) * 64 % D_C, 64, dim=1)
        cp.async_copy_global_to_shared(chunk, base + ((CH0 + k) * 64 + cols)[None, :], mask=valid[:, None])
    cp.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _landed(bar, phase, GATHER: gl.constexpr):
    """Waits until a copy group has landed; a gathered one (written by cp.async, the generic proxy) is
    then fenced for the tensor cores, which read shared memory through the async proxy."""
    mbarrier.wait(bar, phase)
    if GATHER:
        fence_async_shared()


@gluon.jit
def _stage_q(job, sm, b, blk, D_C: gl.constexpr, D_R: gl.constexpr, ld: gl.constexpr):
    """Q of row block blk (rows past M are zeros) into shared memory, 64 columns at a time."""
    rows_q = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, ld))
    cols_q = gl.arange(0, 64, gl.SliceLayout(0, ld))
    q_rows = job.q_ptr + b.to(gl.int64) * job.stride_qb + rows_q.to(gl.int64)[:, None] * (D_C + D_R)
    q_base = q_rows + cols_q[None, :]
    q_ok = (rows_q < job.M)[:, None] & (cols_q >= 0)[None, :]
    sm.qr_smem.store(gl.load(q_base + D_C, mask=q_ok, other=0.0))
    for k in gl.static_range(D_C // 64):
        sm.qc_smem.slice(k * 64, 64, dim=1).store(gl.load(q_base + k * 64, mask=q_ok, other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _wg0(job, sm, cst):
    """Warpgroup 0: Q, scores, softmax, P for warpgroup 1, and O's first latent half."""
    D_C: gl.constexpr = cst.D_C
    D_R: gl.constexpr = cst.D_R
    MASK_MODE: gl.constexpr = cst.MASK_MODE
    GATHER: gl.constexpr = cst.GATHER
    HALF: gl.constexpr = D_C // 2
    dtype: gl.constexpr = job.q_ptr.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])  # fmt: skip
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
    cols = gl.arange(0, BN, gl.SliceLayout(0, s_layout))

    g = 0  # tiles this program has started (program-wide: buffer g % 2, phase (g // 2) % 2)
    rb_first, count = _row_blocks(job)
    for j in range(count):  # row blocks last first: each program starts at tile 0 of a row block
        rb = rb_first + count - 1 - j
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _block(job, rb)
        n = gl.maximum(v_end - v_lo, 0)
        for i in gl.static_range(2):  # the first two tiles' groups of this partition
            kv_rows, kv_ok = _gather_rows(job, b, (v_lo + i) * BN, seqlen, GATHER)
            _issue_group(
                job, cst, sm.full_r, sm.kr_smem, g + i, i, n, v_lo, b, seqlen, kv_rows, kv_ok, D_C // 64, 1
            )
            _issue_group(
                job, cst, sm.full_0, sm.kc_smem, g + i, i, n, v_lo, b, seqlen, kv_rows, kv_ok, 0, HALF // 64
            )
        _stage_q(job, sm, b, blk, D_C, D_R, ld)

        rows = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
        bits = _row_bits(job, b, rows, MASK_MODE)
        acc = gl.zeros([BM, HALF], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
        for i in range(n):
            v = v_lo + i
            buf = g % 2
            phase = (g // 2) & 1
            kv_rows, kv_ok = _gather_rows(job, b, (v + 2) * BN, seqlen, GATHER)  # tile i + 2's, a tile ahead
            if v * BN + BN > seqlen:  # the request's last tile: zero the rows past its end
                mbarrier.wait(sm.full_r.index(buf), phase)
                mbarrier.wait(sm.full_0.index(buf), phase)
                mbarrier.wait(sm.full_1.index(buf), phase)
                _zero_rows(sm.kr_smem.index(buf), v * BN, seqlen, ld)
                _zero_rows(sm.kc_smem.index(buf), v * BN, seqlen, ld)
                fence_async_shared()
                gl.thread_barrier()
            kc_lo = sm.kc_smem.index(buf).slice(0, HALF, dim=1)
            kc_hi = sm.kc_smem.index(buf).slice(HALF, HALF, dim=1)
            _landed(sm.full_r.index(buf), phase, GATHER)
            kr = sm.kr_smem.index(buf)
            s = warpgroup_mma(sm.qr_smem, kr.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _landed(sm.full_0.index(buf), phase, GATHER)
            s = warpgroup_mma(sm.qc_smem.slice(0, HALF, dim=1), kc_lo.permute((1, 0)), s, is_async=True)
            _landed(sm.full_1.index(buf), phase, GATHER)
            s = warpgroup_mma(sm.qc_smem.slice(HALF, HALF, dim=1), kc_hi.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            gl.thread_barrier()  # every warp is past this tile's scores: its rope buffer is free
            _issue_group(job, cst, sm.full_r, sm.kr_smem, g + 2, i + 2, n, v_lo, b, seqlen, kv_rows, kv_ok,
                         D_C // 64, 1)  # fmt: skip
            if v >= n_free:
                s = _tree_mask(s, job, b, rows, bits, v * BN + cols, prefix, seqlen, MASK_MODE)
            s = s * job.qk_scale
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            mbarrier.wait(sm.p_empty, (g - 1) & 1, pred=g > 0)  # warpgroup 1 is done with the previous P
            sm.p_smem.store(p.to(dtype))
            sm.a_smem.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(sm.p_full)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            acc = warpgroup_mma(sm.p_smem, kc_lo, acc * alpha_o[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # every warp is done with this tile's first half
            _issue_group(job, cst, sm.full_0, sm.kc_smem, g + 2, i + 2, n, v_lo, b, seqlen, kv_rows, kv_ok,
                         0, HALF // 64)  # fmt: skip
            g += 1
        # the row sums for warpgroup 1's half of O
        mbarrier.wait(sm.l_empty, (j - 1) & 1, pred=j > 0)
        sm.l_smem.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(sm.l_full)
        _store_block(job, acc, m_i, l_i, b, blk, rb, v_lo, v_hi, 0, D_C, o_layout, s_layout, True)


@gluon.jit
def _wg1(job, sm, cst):
    """Warpgroup 1: O's second latent half from warpgroup 0's P, and its copies of that half."""
    D_C: gl.constexpr = cst.D_C
    GATHER: gl.constexpr = cst.GATHER
    HALF: gl.constexpr = D_C // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])  # fmt: skip
    g = 0
    rb_first, count = _row_blocks(job)
    for j in range(count):
        rb = rb_first + count - 1 - j
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _block(job, rb)
        n = gl.maximum(v_end - v_lo, 0)
        for i in gl.static_range(2):
            kv_rows, kv_ok = _gather_rows(job, b, (v_lo + i) * BN, seqlen, GATHER)
            _issue_group(job, cst, sm.full_1, sm.kc_smem, g + i, i, n, v_lo, b, seqlen, kv_rows, kv_ok,
                         HALF // 64, HALF // 64)  # fmt: skip
        acc = gl.zeros([BM, HALF], gl.float32, o_layout)
        for i in range(n):
            buf = g % 2
            kv_rows, kv_ok = _gather_rows(job, b, (v_lo + i + 2) * BN, seqlen, GATHER)  # a tile ahead
            mbarrier.wait(sm.p_full, g & 1)
            _landed(sm.full_1.index(buf), (g // 2) & 1, GATHER)
            alpha = sm.a_smem.load(gl.SliceLayout(1, o_layout))
            kc_hi = sm.kc_smem.index(buf).slice(HALF, HALF, dim=1)
            acc = warpgroup_mma(sm.p_smem, kc_hi, acc * alpha[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # every warp is done with P, alpha and this tile's second half
            mbarrier.arrive(sm.p_empty)
            _issue_group(job, cst, sm.full_1, sm.kc_smem, g + 2, i + 2, n, v_lo, b, seqlen, kv_rows, kv_ok,
                         HALF // 64, HALF // 64)  # fmt: skip
            g += 1
        mbarrier.wait(sm.l_full, j & 1)
        l_i = sm.l_smem.load(gl.SliceLayout(1, o_layout))
        gl.thread_barrier()
        mbarrier.arrive(sm.l_empty)
        _store_block(job, acc, l_i, l_i, b, blk, rb, v_lo, v_hi, HALF, D_C, o_layout, o_layout, False)


@gluon.jit
def gluon_wait_then_release(PDL: gl.constexpr):
    """kernels/_pdl.wait_then_release for this Gluon kernel: the same two PTX instructions, first thing."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)  # fmt: skip
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _attention_kernel(
    q_ptr,  # [b, M, D_C + D_R] (M = t * h rows, row = node * h + head)
    desc,  # TMA descriptor of the cache viewed as [rows, D_C + D_R], boxes of 64 x 64
    kv_ptr,  # the cache, for the gathered copies (GATHER)
    seqlens_ptr,  # [b] int
    bt_ptr,  # block table [b, pages] (paged) or unused
    vis_ptr,  # visibility [b, t, t] uint8, ancestor bits [b, t] int64, or unused (causal)
    out_ptr,  # [b, M, D_C] in q's dtype: the row blocks one program covers whole
    lse_ptr,  # [b, M] float32
    part_ptr,  # [2 * programs, BM, D_C] float32: the pieces of cut row blocks
    plse_ptr,  # [2 * programs, BM] float32
    sched_ptr,  # int32 [5]: NT, PER, units, programs, groups (mla_attention_schedule), when SCHED_ON_DEVICE
    NT,  # else the schedule from the host: tiles per row block,
    PER,  # tiles per program,
    UNITS,  # units,
    GROUPS,  # and programs per plane (0: flat)
    T,
    H,
    M,
    B,  # requests
    qk_scale,  # softmax scale * log2(e)
    cap,  # rows per request of a contiguous cache
    page_size,
    stride_qb,
    stride_btb,
    stride_vb,
    stride_vi,
    D_C: gl.constexpr,
    D_R: gl.constexpr,
    PAGED: gl.constexpr,
    MASK_MODE: gl.constexpr,
    GATHER: gl.constexpr,  # any page size: rows gathered by cp.async through the block table, not TMA
    SCHED_ON_DEVICE: gl.constexpr,
    num_warps: gl.constexpr,  # 4: warpgroup 0; warpgroup 1 is the worker partition
    PDL: gl.constexpr = False,
):
    gluon_wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    c = gl.program_id(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    if SCHED_ON_DEVICE:
        nt = gl.load(sched_ptr)
        per = gl.load(sched_ptr + 1)
        units = gl.load(sched_ptr + 2)
        groups = gl.load(sched_ptr + 4)
    else:
        nt = gl.to_tensor(NT)
        per = gl.to_tensor(PER)
        units = gl.to_tensor(UNITS)
        groups = gl.to_tensor(GROUPS)
    u0 = c * per  # flat: units c * PER onwards (none past the end)
    u1 = gl.minimum(u0 + per, units)
    if groups > 0:  # aligned: the (c % G)-th run of plane c // G
        plane = gl.to_tensor(B) * nt
        lo = (c % groups) * per
        u0 = gl.minimum((c // groups) * plane + gl.minimum(lo, plane), units)
        u1 = gl.minimum((c // groups) * plane + gl.minimum(lo + per, plane), units)
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
    arrivals: gl.constexpr = WARPGROUP if GATHER else 1  # each copying thread, or the TMA's expect
    for k in gl.static_range(2):
        mbarrier.init(full_r.index(k), count=arrivals)
        mbarrier.init(full_0.index(k), count=arrivals)
        mbarrier.init(full_1.index(k), count=arrivals)
    for k in gl.static_range(4):
        mbarrier.init(sync.index(k), count=1)
    # (scalars as tensors: the JIT passes an int argument equal to 1 as a constexpr)
    job = Job(q_ptr, desc, kv_ptr, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr, plse_ptr,
              gl.to_tensor(T), gl.to_tensor(H), gl.to_tensor(M), gl.to_tensor(B), nt, u0, u1, c,
              gl.to_tensor(qk_scale), gl.to_tensor(cap), gl.to_tensor(page_size), gl.to_tensor(stride_qb),
              gl.to_tensor(stride_btb), gl.to_tensor(stride_vb), gl.to_tensor(stride_vi))  # fmt: skip
    sm = Smem(qc_smem, qr_smem, kc_smem, kr_smem, p_smem, a_smem, l_smem, full_r, full_0, full_1,
              sync.index(0), sync.index(1), sync.index(2), sync.index(3))  # fmt: skip
    args = (job, sm, Consts(D_C, D_R, PAGED, MASK_MODE, GATHER))
    gl.warp_specialize([(_wg0, args), (_wg1, args)], [4], [WORKER_REGS])


@dataclass(frozen=True)
class Launch:
    """One forward's launch of the kernel: the grid (programs), the schedule (from the host when the
    plan knew the lengths, else on the device), the piece workspace, and whether the merge must run
    (False only when the plan knew no row block is cut)."""

    programs: int
    host: Schedule | None
    sched: torch.Tensor  # int32 [5] on the device (when host is None)
    part: torch.Tensor  # [2 * programs, BLOCK_M, d_c] float32
    plse: torch.Tensor  # [2 * programs, BLOCK_M] float32
    merge: bool
    cut_blocks: int  # a bound on the row blocks the schedule cuts (the merge's grid)
    max_pieces: int  # a bound on one row block's pieces


def plan_launch(p: Problem, dtype: torch.dtype, device: torch.device, bounds: LaunchBounds) -> Launch:
    """plan_attention's call (attention.py): the launch of p within bounds (their max_seqlen and
    num_splits; dtype is not needed: the pieces are float32, and the kernel takes the cache's dtype
    from its TMA descriptor at run time)."""
    return plan(p, device, bounds.max_seqlen, bounds.num_splits)


def plan(p: Problem, device: torch.device, max_seqlen: int | None, forced: int = 0) -> Launch:
    """The launch of problem p: with max_seqlen (the lengths known on the host) the exact grid of the
    host's schedule and a merge only if it cuts a row block; without (a captured forward) the schedule
    computed on the device for any lengths, a grid of one program per multiprocessor and the merge
    always launched. forced: cut each row block's tiles into that many pieces (tests)."""
    sms = device_multiprocessors(device)
    blocks = -(-p.rows // BLOCK_M)
    if max_seqlen is not None:
        host = schedule.schedule(p.b, blocks, -(-max_seqlen // TILE), sms, forced)
        sched, programs, merge = p.seqlens, host.programs, host.cuts()
    else:
        host, sched = None, schedule.device_schedule(p.seqlens, blocks, sms, TILE, forced)
        programs, merge = (p.b * blocks * forced if forced else sms), True
    part = torch.empty(2 * programs, BLOCK_M, p.d_v, dtype=torch.float32, device=device)
    plse = torch.empty(2 * programs, BLOCK_M, dtype=torch.float32, device=device)
    pieces = schedule.max_pieces(p.b, blocks, sms, forced)
    cut = schedule.cut_blocks(p.b, blocks, programs, forced)
    return Launch(programs, host, sched, part, plse, merge, cut, pieces)


def run(launch: Launch, p: Problem, q: torch.Tensor, kv_cache: torch.Tensor, out, lse) -> None:
    """out [b, t, h, d_c], lse [b, t, h] <- the attention of q [b, t, h, d] over kv_cache: the kernel,
    then the merge of the cut row blocks' pieces when the launch has one. ValueError for a cache the
    kernel cannot read through its TMA descriptor (not contiguous, or not 16-byte aligned)."""
    if not (kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0):
        raise ValueError("kv_cache: the Hopper kernel was planned: this layer's cache must be contiguous and "
                         "16-byte aligned too")  # fmt: skip
    _launch_kernel(launch, p, q, kv_cache, out, lse)
    if launch.merge:
        _launch_merge(launch, p, out, lse)


def _launch_merge(launch: Launch, p: Problem, out, lse) -> None:
    """The merge alone: the cut row blocks' pieces (the kernel's workspace) into out / lse."""
    merge_pieces(launch.part, launch.plse, out, lse, launch.host or launch.sched, p.rows, BLOCK_M,
                 launch.cut_blocks, launch.max_pieces)  # fmt: skip


def _launch_kernel(launch: Launch, p: Problem, q: torch.Tensor, kv_cache: torch.Tensor, out, lse) -> None:
    """The kernel alone: final rows into out / lse, the cut row blocks' pieces into the workspace."""
    page_size = kv_cache.shape[1] if p.paged else 1
    nt, per, units, _, groups = launch.host or (0, 0, 0, 0, 0)
    _attention_kernel[(launch.programs,)](
        q, cache_desc(kv_cache), kv_cache, p.seqlens, p.table, p.mask.tensor, out, lse, launch.part,
        launch.plse, launch.sched, nt, per, units, groups, p.t, p.h, p.rows, p.b, p.qk_scale,
        kv_cache.shape[1], page_size, q.stride(0), p.table.stride(0), p.mask.stride_b, p.mask.stride_i,
        D_C=p.d_v, D_R=p.d - p.d_v, PAGED=p.paged, MASK_MODE=p.mask.mode,
        GATHER=gathers(kv_cache, p.paged), SCHED_ON_DEVICE=launch.host is None,
        num_warps=4,
        **pdl.launch(q.device),
    )  # fmt: skip
