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

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from .mla_attention_sm90 import (
    BLOCK_M,
    ROLES_TILE,
    _final_ptrs,
    _pipe_row,
    _row_block,
    _slot_ptrs,
    _store_cols,
    _store_lse,
    _tree_mask,
    _zero_rows,
    cache_desc,
)

BM = gl.constexpr(BLOCK_M)  # query rows per row block (the dispatcher's blocks and merge use BLOCK_M)
BN = gl.constexpr(ROLES_TILE)  # cache slots per tile (the dispatcher's schedule unit, tile_rows("roles"))
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


@aggregate
class Job:
    """The launch's pointers, sizes and strides as both partitions get them (_roles_kernel's arguments,
    plus this program's units u0 .. u1 - 1 and its index c)."""

    q_ptr: gl.tensor
    desc: tma.tensor_descriptor
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
    MB: gl.tensor
    NT: gl.tensor
    PER: gl.tensor
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
    stride_pb: gl.tensor
    stride_ps: gl.tensor
    stride_lb: gl.tensor
    stride_ls: gl.tensor

    @gluon.constexpr_function
    def __init__(self, q_ptr, desc, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr, plse_ptr, T, H,
                 M, MB, NT, PER, u0, u1, c, qk_scale, cap, page_size, stride_qb, stride_btb, stride_vb,
                 stride_vi, stride_pb, stride_ps, stride_lb, stride_ls):  # fmt: skip
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
def _block(job, rb):
    """Row block rb of this program (mla_attention_sm90._row_block with 64-slot tiles)."""
    return _row_block(rb, job.u0, job.u1, job.MB, job.NT, job.seqlens_ptr, job.T, BN)


@gluon.jit
def _split_ptrs(job, b, rb):
    """This program's float32 partial slot of row block rb (mla_attention_sm90._slot_ptrs)."""
    return _slot_ptrs(job.part_ptr, job.plse_ptr, b, job.c, rb, job.NT, job.PER, job.stride_pb, job.stride_ps,
                      job.stride_lb, job.stride_ls)  # fmt: skip


@gluon.jit
def _issue_group(job, bars, bufs, g, i, n, v_lo, b, seqlen, CH0: gl.constexpr, NCH: gl.constexpr,
                 D_C: gl.constexpr, PAGED: gl.constexpr):  # fmt: skip
    """TMA of one group of the row block's local tile i (program tile g), if the block has that tile
    (i < n): cache columns CH0 * 64 .. (CH0 + NCH) * 64 of the tile's 64 rows into the same columns of
    buffer g % 2 of bufs (the rope buffers take CH0 = D_C / 64 into their columns 0 ..); bar g % 2
    completes when the group has landed."""
    row = _pipe_row(b, (v_lo + i) * BN, seqlen, job.bt_ptr, job.stride_btb, job.cap, job.page_size, PAGED)
    bar = bars.index(g % 2)
    dst = bufs.index(g % 2)
    pred = i < n
    mbarrier.expect(bar, NCH * 64 * 64 * 2, pred=pred)
    for k in gl.static_range(NCH):
        chunk = dst.slice((CH0 + k) * 64 % D_C, 64, dim=1)
        tma.async_copy_global_to_shared(job.desc, [row, (CH0 + k) * 64], bar, chunk, pred=pred)


@gluon.jit
def _wg0(job, sm, cst):
    """Warpgroup 0: Q, scores, softmax, P for warpgroup 1, and O's first latent half."""
    D_C: gl.constexpr = cst.D_C
    D_R: gl.constexpr = cst.D_R
    PAGED: gl.constexpr = cst.PAGED
    MASK_MODE: gl.constexpr = cst.MASK_MODE
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
    rb_first = job.u0 // job.NT
    rb_last = (job.u1 - 1) // job.NT
    count = rb_last - rb_first + 1
    for j in range(count):  # row blocks last first, as in "pipe"
        rb = rb_last - j
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _block(job, rb)
        n = gl.maximum(v_end - v_lo, 0)
        for i in gl.static_range(2):  # the first two tiles' groups of this partition
            _issue_group(job, sm.full_r, sm.kr_smem, g + i, i, n, v_lo, b, seqlen, D_C // 64, 1, D_C, PAGED)
            _issue_group(job, sm.full_0, sm.kc_smem, g + i, i, n, v_lo, b, seqlen, 0, HALF // 64, D_C, PAGED)
        # Q of this row block (rows past M are zeros), 64 columns at a time
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

        rows = blk * BM + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BM, HALF], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
        for i in range(n):
            v = v_lo + i
            buf = g % 2
            phase = (g // 2) & 1
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
            mbarrier.wait(sm.full_r.index(buf), phase)
            kr = sm.kr_smem.index(buf)
            s = warpgroup_mma(sm.qr_smem, kr.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(sm.full_0.index(buf), phase)
            s = warpgroup_mma(sm.qc_smem.slice(0, HALF, dim=1), kc_lo.permute((1, 0)), s, is_async=True)
            mbarrier.wait(sm.full_1.index(buf), phase)
            s = warpgroup_mma(sm.qc_smem.slice(HALF, HALF, dim=1), kc_hi.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            gl.thread_barrier()  # every warp is past this tile's scores: its rope buffer is free
            _issue_group(
                job, sm.full_r, sm.kr_smem, g + 2, i + 2, n, v_lo, b, seqlen, D_C // 64, 1, D_C, PAGED
            )
            if v >= n_free:
                s = _tree_mask(s, job.vis_ptr, b, rows, v * BN + cols, prefix, seqlen, job.M, job.H,
                               job.stride_vb, job.stride_vi, MASK_MODE)  # fmt: skip
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
            _issue_group(
                job, sm.full_0, sm.kc_smem, g + 2, i + 2, n, v_lo, b, seqlen, 0, HALF // 64, D_C, PAGED
            )
            g += 1
        # the row sums for warpgroup 1's half of O
        mbarrier.wait(sm.l_empty, (j - 1) & 1, pred=j > 0)
        sm.l_smem.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(sm.l_full)
        if (v_lo == 0) & (v_hi == job.NT):  # the whole row block: final output
            final, final_lse = _final_ptrs(job.out_ptr, job.lse_ptr, b, job.M, D_C)
            _store_cols(acc, l_i, final, blk, job.M, 0, D_C, BM, o_layout)
            _store_lse(m_i, l_i, final_lse, blk, job.M, BM, s_layout)
        else:
            split, split_lse = _split_ptrs(job, b, rb)
            _store_cols(acc, l_i, split, blk, job.M, 0, D_C, BM, o_layout)
            _store_lse(m_i, l_i, split_lse, blk, job.M, BM, s_layout)


@gluon.jit
def _wg1(job, sm, cst):
    """Warpgroup 1: O's second latent half from warpgroup 0's P, and its copies of that half."""
    D_C: gl.constexpr = cst.D_C
    PAGED: gl.constexpr = cst.PAGED
    HALF: gl.constexpr = D_C // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])  # fmt: skip

    g = 0
    rb_first = job.u0 // job.NT
    rb_last = (job.u1 - 1) // job.NT
    count = rb_last - rb_first + 1
    for j in range(count):
        rb = rb_last - j
        b, blk, v_lo, v_hi, v_end, seqlen, prefix, n_free = _block(job, rb)
        n = gl.maximum(v_end - v_lo, 0)
        for i in gl.static_range(2):
            _issue_group(
                job, sm.full_1, sm.kc_smem, g + i, i, n, v_lo, b, seqlen, HALF // 64, HALF // 64, D_C, PAGED
            )
        acc = gl.zeros([BM, HALF], gl.float32, o_layout)
        for i in range(n):
            buf = g % 2
            mbarrier.wait(sm.p_full, g & 1)
            mbarrier.wait(sm.full_1.index(buf), (g // 2) & 1)
            alpha = sm.a_smem.load(gl.SliceLayout(1, o_layout))
            kc_hi = sm.kc_smem.index(buf).slice(HALF, HALF, dim=1)
            acc = warpgroup_mma(sm.p_smem, kc_hi, acc * alpha[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # every warp is done with P, alpha and this tile's second half
            mbarrier.arrive(sm.p_empty)
            _issue_group(
                job,
                sm.full_1,
                sm.kc_smem,
                g + 2,
                i + 2,
                n,
                v_lo,
                b,
                seqlen,
                HALF // 64,
                HALF // 64,
                D_C,
                PAGED,
            )
            g += 1
        mbarrier.wait(sm.l_full, j & 1)
        l_i = sm.l_smem.load(gl.SliceLayout(1, o_layout))
        gl.thread_barrier()
        mbarrier.arrive(sm.l_empty)
        if (v_lo == 0) & (v_hi == job.NT):
            final, final_lse = _final_ptrs(job.out_ptr, job.lse_ptr, b, job.M, D_C)
            _store_cols(acc, l_i, final, blk, job.M, HALF, D_C, BM, o_layout)
        else:
            split, split_lse = _split_ptrs(job, b, rb)
            _store_cols(acc, l_i, split, blk, job.M, HALF, D_C, BM, o_layout)


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
    # (scalars as tensors: the JIT passes an int argument equal to 1 as a constexpr)
    job = Job(q_ptr, desc, seqlens_ptr, bt_ptr, vis_ptr, out_ptr, lse_ptr, part_ptr, plse_ptr,
              gl.to_tensor(T), gl.to_tensor(H), gl.to_tensor(M), gl.to_tensor(MB), gl.to_tensor(NT),
              gl.to_tensor(PER), u0, u1, c, gl.to_tensor(qk_scale), gl.to_tensor(cap),
              gl.to_tensor(page_size), gl.to_tensor(stride_qb), gl.to_tensor(stride_btb),
              gl.to_tensor(stride_vb), gl.to_tensor(stride_vi), gl.to_tensor(stride_pb),
              gl.to_tensor(stride_ps), gl.to_tensor(stride_lb), gl.to_tensor(stride_ls))  # fmt: skip
    sm = Smem(qc_smem, qr_smem, kc_smem, kr_smem, p_smem, a_smem, l_smem, full_r, full_0, full_1,
              sync.index(0), sync.index(1), sync.index(2), sync.index(3))  # fmt: skip
    args = (job, sm, Consts(D_C, D_R, PAGED, MASK_MODE))
    gl.warp_specialize([(_wg0, args), (_wg1, args)], [4], [WORKER_REGS])


def launch(q, kv_cache, cache_seqlens, bt, vis, mask_mode, stride_vb, stride_vi, out, lse, part, plse, t, h,
           rows, qk_scale, paged, page_size, programs, per, tiles):  # fmt: skip
    """Runs the "roles" kernel over the schedule (programs, per, tiles) of mla_attention_sm90.schedule
    with 64-row blocks and 64-slot tiles (same cache conditions as "pipe": pipe_applies)."""
    b, d = q.shape[0], q.shape[-1]
    d_c = out.shape[-1]
    blocks = -(-rows // BLOCK_M)
    _roles_kernel[(programs,)](
        q, cache_desc(kv_cache), cache_seqlens, bt, vis, out, lse, part, plse,
        t, h, rows, blocks, tiles, per, b * blocks * tiles, qk_scale, kv_cache.shape[1], page_size,
        q.stride(0), bt.stride(0), stride_vb, stride_vi,
        part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, D_R=d - d_c, PAGED=paged, MASK_MODE=mask_mode, num_warps=4,
    )  # fmt: skip
