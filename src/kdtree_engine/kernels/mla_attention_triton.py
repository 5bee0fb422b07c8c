"""Tree-verify MLA attention (absorbed form) in Triton: the kernel for every GPU and, through the
Triton interpreter, the CPU (CI). Same contract as ref/mla_attention.py.

The t*h query rows of a request form one M dimension, so every KV tile is loaded once per block of
BLOCK_M rows and fed to two tensor-core products (QK^T over d_c + d_r, then PV over the first d_v = d_c
dims of the same tile). The KV range of each request is cut into `num_splits` chunks (split-KV), sized
from the request's own length on the device; inside a chunk, whole tiles that lie in the prefix run
without any mask, and the few tiles that touch the tree (the last t slots) or the end of the chunk run
masked: column j of the tree is visible to row (i, head) iff visible[i, j] (in causal mode a row block
also stops at its last node's column). Chunks are merged by their log-sum-exp
(kernels/mla_attention_merge.py); with one chunk the kernel writes the final output directly.

Row-invariant mode (`invariant=True` in the plan; issue 32): a query row gets the same bits whatever
else shares its launch, and a tree node gets the bits the same token gets when it is decoded alone after
its ancestors. A row's keys are taken in position order: the prefix at positions = slots, then its
ancestors (itself included) at positions prefix + 0, 1, ..., in index order (a parent's index is below
its children's), read from their slots through a per-node table (`ancestor_slots`). Every boundary is
fixed by position: KV tiles of BLOCK_N positions from position 0, splits of CHUNK positions, one launch
shape for every call, the merge folding a fixed number of pieces per round. Tiles below the first tile
that holds a tree position are shared by the block's rows; from that tile on, each node of the block
runs its own gathered tiles, the block's other rows masked (an update that leaves them exactly as they
were). An autoregressive step is a tree of one node, so it runs the same arithmetic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._align import aligned, stride_align
from kdtree_engine.kernels._device import device_multiprocessors
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.kernels.mla_attention_args import MASK_BITS, MASK_CAUSAL, LaunchBounds, Problem
from kdtree_engine.kernels.mla_attention_merge import merge_splits
from kdtree_engine.ref.mla_attention import bits_to_visibility


@dataclass(frozen=True)
class Config:
    """Launch shape of the split-KV kernel."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _row_offsets(b, pos, valid, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED: tl.constexpr):
    """Element offsets of cache rows `pos` [BLOCK_N] of request b (contiguous or paged cache)."""
    if PAGED:
        page = tl.load(bt_ptr + b * stride_btb + pos // page_size, mask=valid, other=0).to(tl.int64)
        return page * stride_kb + (pos % page_size).to(tl.int64) * stride_ks
    else:
        return b.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_ks


@triton.jit
def _tree_visible(vis_ptr, b, rows, j, row_ok, col_ok, stride_vb, stride_vi, H, MASK_MODE: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: query row (i = rows // H) sees tree column j (j >= 0 where col_ok)."""
    i = rows // H  # [BLOCK_M] tree node of each query row
    ok = row_ok[:, None] & col_ok[None, :]
    if MASK_MODE == 0:  # visibility [b, t, t] as uint8
        v = tl.load(vis_ptr + b * stride_vb + i[:, None] * stride_vi + j[None, :], mask=ok, other=0)
        return ok & (v != 0)
    elif MASK_MODE == 1:  # ancestor_bits [b, t] int64, bit j of row i
        bits = tl.load(vis_ptr + b * stride_vb + i, mask=row_ok, other=0)
        jj = tl.minimum(tl.maximum(j, 0), 63).to(tl.int64)
        return ok & (((bits[:, None] >> jj[None, :]) & 1) != 0)
    else:  # causal
        return ok & (j[None, :] <= i[:, None])


@triton.jit
def _load_rows(ptr, rows, offs_d, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """[len(rows), BLOCK_D] tile; masks only where a constexpr says they can matter (else plain loads)."""
    ptrs = ptr + rows[:, None] + offs_d[None, :]
    if MASK_ROWS:
        if BLOCK_D == D:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if BLOCK_D == D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)


@triton.jit
def _scores(
    q_c,
    q_r,
    kv_ptr,
    rows,
    row_ok,
    offs_dc,
    offs_dr,
    qk_scale,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One KV tile: log2-domain scores [BM, BN] and the latent part of the tile [BN, BDC] (the value)."""
    kv_c = _load_rows(kv_ptr, rows, offs_dc, row_ok, D_C, BLOCK_DC, MASKED)  # [BN, BDC]
    if D_R > 0:
        kv_r = _load_rows(kv_ptr + D_C, rows, offs_dr, row_ok, D_R, BLOCK_DR, MASKED)  # [BN, BDR]
        s = tl.dot(q_r, tl.trans(kv_r), input_precision=DOT_PREC)
        s = tl.dot(q_c, tl.trans(kv_c), acc=s, input_precision=DOT_PREC)
    else:
        s = tl.dot(q_c, tl.trans(kv_c), input_precision=DOT_PREC)
    return s * qk_scale, kv_c


@triton.jit
def _update(acc, m_i, l_i, s, kv_c, DOT_PREC: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(kv_c.dtype), kv_c, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _tree_tail(acc, m_i, l_i, q_c, q_r, kv_ptr, anc_ptr, b, rows, row_ok, start0, hi, prefix, T, H, stride_ab,
               stride_ai, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, offs_dc, offs_dr, qk_scale,
               D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
               DOT_PREC: tl.constexpr):  # fmt: skip
    """Row-invariant mode, positions start0 .. hi - 1 (start0 a multiple of BLOCK_N): for each node g of
    the block, its own tiles: position prefix + j is its j-th ancestor's slot (anc[b, g, j], -1 past
    its depth), a position below the prefix its own slot; only g's rows take the tile."""
    cols = tl.arange(0, BLOCK_N)
    first = tl.min(tl.where(row_ok, rows, 2**30), 0) // H
    last = tl.minimum(tl.max(tl.where(row_ok, rows, 0), 0) // H, T - 1)
    for g in range(first, last + 1):
        owner = row_ok & (rows // H == g)
        for start in range(start0, hi, BLOCK_N):
            pos = start + cols
            j = pos - prefix
            in_tree = (j >= 0) & (pos < hi)
            anc = tl.load(anc_ptr + b.to(tl.int64) * stride_ab + g * stride_ai + j, mask=in_tree, other=-1)
            valid = ((j < 0) & (pos < hi)) | (anc >= 0)
            slot = tl.where(j < 0, pos, prefix + anc)
            offsets = _row_offsets(b, slot, valid, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED)
            s, kv_c = _scores(q_c, q_r, kv_ptr, offsets, valid, offs_dc, offs_dr, qk_scale, D_C, D_R,
                              BLOCK_DC, BLOCK_DR, True, DOT_PREC)  # fmt: skip
            s = tl.where(owner[:, None] & valid[None, :], s, float("-inf"))
            acc, m_i, l_i = _update(acc, m_i, l_i, s, kv_c, DOT_PREC)
    return acc, m_i, l_i


# Scalars that vary per call are not specialized (Triton would otherwise compile again for 1 and for
# multiples of 16); cache strides stay specialized for vectorized loads.
_UNSPECIALIZED = [
    "T",
    "stride_ab",
    "stride_ai",
    "H",
    "M",
    "num_splits",
    "stride_btb",
    "stride_vb",
    "stride_vi",
    "stride_lb",
    "stride_ls",
]


@triton.jit(do_not_specialize=_UNSPECIALIZED + ["stride_ob", "stride_os"])
def _split_kv_kernel(
    q_ptr,
    kv_ptr,
    seqlens_ptr,
    vis_ptr,
    anc_ptr,
    bt_ptr,
    out_ptr,
    lse_ptr,
    T,
    H,
    M,
    num_splits,
    qk_scale,
    page_size,
    stride_qb,
    stride_kb,
    stride_ks,
    stride_btb,
    stride_vb,
    stride_vi,
    stride_ob,
    stride_os,
    stride_lb,
    stride_ls,
    stride_ab,
    stride_ai,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    MASK_MODE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CHUNK: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """CHUNK 0: each request's range cut into num_splits chunks sized from its length; CHUNK > 0: the
    row-invariant mode (module docstring), splits of CHUNK positions. stride_ob and stride_os are
    multiples of OUT_ALIGN."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    stride_ob, stride_os = aligned(stride_ob, OUT_ALIGN), aligned(stride_os, OUT_ALIGN)
    pid_m, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    INVARIANT: tl.constexpr = CHUNK > 0
    TREE_TAIL: tl.constexpr = INVARIANT and MASK_MODE != 2
    D: tl.constexpr = D_C + D_R
    HAS_ROPE: tl.constexpr = D_R > 0
    seqlen = tl.load(seqlens_ptr + b).to(tl.int32)
    prefix = seqlen - T
    chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    if INVARIANT:
        chunk = CHUNK
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    if MASK_MODE == 2 or not INVARIANT:  # no row of this block sees past its last node (a tree's nodes come
        # ancestors first: plan_attention's contract); the row-invariant mode keeps its fixed boundaries
        hi = tl.minimum(hi, prefix + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // H, T - 1) + 1)
    shared_end = tl.minimum(hi, prefix)  # tiles below it are the prefix's
    if TREE_TAIL:
        shared_end = tl.minimum(hi, prefix // BLOCK_N * BLOCK_N)  # from the tile of the first tree position
    n_free = tl.maximum(shared_end - lo, 0) // BLOCK_N  # whole tiles inside the prefix

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query rows (i * H + head)
    row_ok = rows < M
    offs_dc = tl.arange(0, BLOCK_DC)
    offs_dr = tl.arange(0, BLOCK_DR)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + rows[:, None].to(tl.int64) * D
    q_c = tl.load(q_base + offs_dc[None, :], mask=row_ok[:, None] & (offs_dc < D_C)[None, :], other=0.0)
    q_r = q_c  # placeholder when there are no rope dims
    if HAS_ROPE:
        q_r = tl.load(
            q_base + D_C + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr < D_R)[None, :], other=0.0
        )

    acc = tl.zeros([BLOCK_M, BLOCK_DC], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n in range(0, n_free):  # prefix tiles: no mask at all
        pos = lo + n * BLOCK_N + cols
        offsets = _row_offsets(b, pos, pos < hi, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED)
        s, kv_c = _scores(q_c, q_r, kv_ptr, offsets, pos < hi, offs_dc, offs_dr, qk_scale, D_C, D_R,
                          BLOCK_DC, BLOCK_DR, INVARIANT, DOT_PREC)  # fmt: skip
        acc, m_i, l_i = _update(acc, m_i, l_i, s, kv_c, DOT_PREC)
    if TREE_TAIL:
        tail0 = lo + n_free * BLOCK_N
        acc, m_i, l_i = _tree_tail(
            acc, m_i, l_i, q_c, q_r, kv_ptr, anc_ptr, b, rows, row_ok, tail0, hi, prefix, T, H, stride_ab,
            stride_ai, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, offs_dc, offs_dr, qk_scale,
            D_C, D_R, BLOCK_DC, BLOCK_DR, BLOCK_M, BLOCK_N, PAGED, DOT_PREC,
        )  # fmt: skip
    else:
        for start in range(lo + n_free * BLOCK_N, hi, BLOCK_N):  # tiles touching the tree or the chunk end
            pos = start + cols
            in_range = pos < hi
            offsets = _row_offsets(
                b, pos, in_range, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED
            )
            s, kv_c = _scores(q_c, q_r, kv_ptr, offsets, in_range, offs_dc, offs_dr, qk_scale, D_C, D_R,
                              BLOCK_DC, BLOCK_DR, True, DOT_PREC)  # fmt: skip
            j = pos - prefix
            tree = _tree_visible(
                vis_ptr, b, rows, j, row_ok, in_range & (j >= 0), stride_vb, stride_vi, H, MASK_MODE
            )
            visible = tree | (in_range & (j < 0))[None, :]
            s = tl.where(visible, s, float("-inf"))
            acc, m_i, l_i = _update(acc, m_i, l_i, s, kv_c, DOT_PREC)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_base = out_ptr + b.to(tl.int64) * stride_ob + split.to(tl.int64) * stride_os
    tl.store(
        o_base + rows[:, None].to(tl.int64) * D_C + offs_dc[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dc < D_C)[None, :],
    )
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + split * stride_ls + rows, lse, mask=row_ok)


SHORT_CACHE = 2048  # decode on a contiguous cache up to this length takes 32-slot tiles (pick_config),
SHORT_BATCH = 4  # at batches up to this one (the sizes it was timed at)


def pick_config(
    dtype: torch.dtype, rows: int, d_c: int, paged: bool = False, max_len: int | None = None, batch: int = 0
) -> Config:
    """Launch shape by dtype and rows per request (t*h): wide M tiles feed the tensor cores when rows
    are many; narrow ones waste less when rows are few (decode); float32 keeps exact fp32 products.
    A paged decode takes 32-slot tiles and 5 stages: the tile's address comes from a load of the block
    table, and Triton's pipeliner spends stages on that chain (64-slot tiles with 3 stages got one
    buffer and no copy in flight); the fastest of the launch shapes timed on pages of 1 (docs/notes/
    kernels.md; pages of 64 go to the Hopper kernel on sm_90). A contiguous decode of at most
    SHORT_BATCH requests whose caches are at most SHORT_CACHE long (max_len, the plan's bound or hint)
    takes 32-slot tiles too, with 3 stages: a request there is a few tiles that one program reads, and
    the smaller tile halves the bytes each copy waits for (faster where timed, batches 1 and 4 up to
    2048 slots; 64-slot tiles stay faster on long caches; larger batches were not timed: docs/notes/
    kernels.md)."""
    if dtype == torch.float32:
        return Config(block_m=16, block_n=32, num_warps=4, num_stages=1)
    if rows <= 16:
        if paged:
            return Config(block_m=16, block_n=32, num_warps=4, num_stages=5)
        if max_len is not None and max_len <= SHORT_CACHE and 0 < batch <= SHORT_BATCH:
            return Config(block_m=16, block_n=32, num_warps=4, num_stages=3)
        return Config(block_m=16, block_n=64, num_warps=4, num_stages=3)
    return Config(block_m=64, block_n=64, num_warps=8 if d_c >= 256 else 4, num_stages=2)


MAX_SPLITS = 128  # the most splits the cost model considers (the merge reads them in rounds of 32)
INVARIANT_CHUNK = 1024  # positions per split in the row-invariant mode (a multiple of every BLOCK_N)


def invariant_config(dtype: torch.dtype, d_c: int) -> Config:
    """The row-invariant mode's one launch shape: a function of the model's dtype and widths only."""
    if dtype == torch.float32:
        return pick_config(dtype, 0, d_c)
    return Config(block_m=64, block_n=64, num_warps=8 if d_c >= 256 else 4, num_stages=2)


def ancestor_slots(p: Problem) -> torch.Tensor | None:
    """[b, t, t] int32: row i lists node i's ancestors, itself last, in index order (a parent's index is
    below its children's), then -1; None for a causal mask. Device ops only."""
    if p.mask.mode == MASK_CAUSAL:
        return None
    if p.mask.mode == MASK_BITS:
        visible = bits_to_visibility(p.mask.tensor, p.t)
    else:
        visible = p.mask.tensor.view(p.b, p.t, p.t) != 0
    index = torch.arange(p.t, device=visible.device, dtype=torch.int32)
    ordered = torch.where(visible, index, p.t).sort(dim=-1).values
    return torch.where(ordered < p.t, ordered, -1).to(torch.int32).contiguous()


@functools.lru_cache(maxsize=4096)  # host time matters: this runs once per forward
def pick_num_splits(b: int, m_blocks: int, max_len: int, cfg: Config, d_c: int, d: int, slots: int) -> int:
    """Split count minimizing a cost model, in units of one KV tile's time on one multiprocessor:
    waves of programs times tiles per program, plus writing and re-reading each split's partial output."""
    tiles = max(1, triton.cdiv(max_len, cfg.block_n))
    merge = cfg.block_m * d_c * 8 / (cfg.block_n * d * 2)  # partial out write + read vs one KV tile
    best, best_cost = 1, float("inf")
    for s in range(1, min(MAX_SPLITS, tiles) + 1):
        programs = b * m_blocks * s
        cost = triton.cdiv(programs, slots) * triton.cdiv(tiles, s)
        if s > 1:
            cost += programs * merge / slots + 2
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


@dataclass(frozen=True)
class Launch:
    """One forward's launch of the split-KV kernel: its shape, the split count (fixed for the forward;
    each request's chunks are sized from its own length on the device), and the split workspace
    (None with one split: the kernel then writes the final output)."""

    config: Config
    num_splits: int
    part: torch.Tensor | None  # [b, num_splits, rows, d_c] float32
    plse: torch.Tensor | None  # [b, num_splits, rows] float32
    chunk: int = 0  # positions per split in the row-invariant mode, 0 otherwise
    ancestors: torch.Tensor | None = None  # ancestor_slots, the row-invariant mode's tree table


def plan_launch(p: Problem, dtype: torch.dtype, device: torch.device, bounds: LaunchBounds) -> Launch:
    """plan_attention's call (attention.py): the launch of p within bounds (their steer, num_splits
    and invariant), over the device's multiprocessors."""
    slots = device_multiprocessors(device)
    splits = bounds.num_splits or None
    return plan(p, dtype, device, bounds.steer, slots, num_splits=splits, invariant=bounds.invariant)


def plan(p: Problem, dtype: torch.dtype, device: torch.device, max_len: int, slots: int,
         config: Config | None = None, num_splits: int | None = None,
         invariant: bool = False) -> Launch:  # fmt: skip
    """The launch for problem p in `dtype`: max_len bounds the lengths (steers the split count); slots
    is the number of programs that run at once (multiprocessors); invariant: the row-invariant mode
    (module docstring), whose splits are fixed by position and always merged."""
    if invariant:
        cfg = invariant_config(dtype, p.d_v)
        splits = triton.cdiv(max(max_len, 1), INVARIANT_CHUNK)
        part = torch.empty(p.b, splits, p.rows, p.d_v, dtype=torch.float32, device=device)
        plse = torch.empty(p.b, splits, p.rows, dtype=torch.float32, device=device)
        return Launch(cfg, splits, part, plse, INVARIANT_CHUNK, ancestor_slots(p))
    cfg = config or pick_config(dtype, p.rows, p.d_v, p.paged, max_len, p.b)
    m_blocks = triton.cdiv(p.rows, cfg.block_m)
    splits = num_splits or pick_num_splits(p.b, m_blocks, max_len, cfg, p.d_v, p.d, slots)
    if splits == 1:
        return Launch(cfg, 1, None, None)
    part = torch.empty(p.b, splits, p.rows, p.d_v, dtype=torch.float32, device=device)
    plse = torch.empty(p.b, splits, p.rows, dtype=torch.float32, device=device)
    return Launch(cfg, splits, part, plse)


def run(launch: Launch, p: Problem, q: torch.Tensor, kv_cache: torch.Tensor, out, lse) -> None:
    """out [b, t, h, d_c], lse [b, t, h] <- the attention of q [b, t, h, d] (contiguous) over
    kv_cache: the split-KV kernel (a cache whose rows are not contiguous is copied first), then the
    merge of its splits when there are several."""
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    _launch_kernel(launch, p, q, kv_cache, out, lse)
    if launch.part is not None:
        merge_splits(launch.part, launch.plse, out.view(p.b, p.rows, p.d_v), lse.view(p.b, p.rows),
                     fixed_rounds=launch.chunk > 0)  # fmt: skip


def _launch_kernel(launch: Launch, p: Problem, q: torch.Tensor, kv_cache: torch.Tensor, out, lse) -> None:
    """The kernel alone: out / lse with one split, else the launch's split workspace."""
    cfg, rows, d_c = launch.config, p.rows, p.d_v
    if launch.part is None:
        part, plse, sob, sos, slb, sls = out, lse, rows * d_c, 0, rows, 0
    else:
        part, plse = launch.part, launch.plse
        sob, sos, slb, sls = part.stride(0), part.stride(1), plse.stride(0), plse.stride(1)
    page_size = kv_cache.shape[1] if p.paged else 1
    anc = launch.ancestors if launch.ancestors is not None else p.seqlens  # never read without a tree
    anc_strides = (anc.stride(0), anc.stride(1)) if launch.ancestors is not None else (0, 0)
    _split_kv_kernel[(triton.cdiv(rows, cfg.block_m), launch.num_splits, p.b)](
        q, kv_cache, p.seqlens, p.mask.tensor, anc, p.table, part, plse,
        p.t, p.h, rows, launch.num_splits, p.qk_scale, page_size,
        q.stride(0), kv_cache.stride(0), kv_cache.stride(1), p.table.stride(0), p.mask.stride_b,
        p.mask.stride_i, sob, sos, slb, sls, *anc_strides,
        D_C=d_c, D_R=p.d - d_c, BLOCK_DC=triton.next_power_of_2(d_c),
        BLOCK_DR=max(16, triton.next_power_of_2(max(p.d - d_c, 1))), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        PAGED=p.paged, MASK_MODE=p.mask.mode, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        CHUNK=launch.chunk, OUT_ALIGN=stride_align(part.element_size(), sob, sos), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch(q.device),
    )  # fmt: skip
