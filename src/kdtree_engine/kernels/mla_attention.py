"""Tree-verify MLA attention (absorbed form) in Triton. Same contract as ref/mla_attention.py.

Design (DESIGN.md section 2): the t*h query rows of a request form one M dimension, so every KV tile is
loaded once per block of BLOCK_M rows and fed to two tensor-core products (QK^T over d_c + d_r, then
PV over the first d_v = d_c dims of the same tile). The KV range of each request is cut into
`num_splits` chunks (split-KV); inside a chunk, whole tiles that lie in the prefix run without any mask,
and the few tiles that touch the tree (the last t slots) or the end of the chunk run masked: column j
of the tree is visible to row (i, head) iff visible[i, j] (in causal mode a row block also stops at its
last node's column). Chunks are merged by their log-sum-exp in a
second small kernel; with one chunk the first kernel writes the final output directly.

Kernels assume validated inputs (attention.py validates at the public boundary).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdtree_engine.attention import BACKENDS  # defined with the public op (no triton import there)
from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels._device import multiprocessors

LOG2E = 1.4426950408889634
MASK_VISIBILITY, MASK_BITS, MASK_CAUSAL = 0, 1, 2


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


# Scalars that vary per call are not specialized (Triton would otherwise compile again for 1 and for
# multiples of 16); cache strides stay specialized for vectorized loads.
_UNSPECIALIZED = [
    "T",
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
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    MASK_MODE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TAIL_UNIT: tl.constexpr = 0,
):
    """TAIL_UNIT > 0: one split only, the slots from the last multiple of TAIL_UNIT inside the prefix to
    the end, written as split `num_splits` (the sm_90 prefix kernel wrote splits 0 .. num_splits - 1)."""
    pid_m, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    D: tl.constexpr = D_C + D_R
    HAS_ROPE: tl.constexpr = D_R > 0
    seqlen = tl.load(seqlens_ptr + b).to(tl.int32)
    prefix = seqlen - T
    if TAIL_UNIT > 0:
        lo = (prefix // TAIL_UNIT) * TAIL_UNIT
        hi = seqlen
        split = num_splits
    else:
        chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seqlen)
    if MASK_MODE == 2:  # causal (prefill): no row of this block sees past its last node
        hi = tl.minimum(hi, prefix + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // H, T - 1) + 1)
    n_free = tl.maximum(tl.minimum(hi, prefix) - lo, 0) // BLOCK_N  # whole tiles inside the prefix

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
                          BLOCK_DC, BLOCK_DR, False, DOT_PREC)  # fmt: skip
        acc, m_i, l_i = _update(acc, m_i, l_i, s, kv_c, DOT_PREC)
    for start in range(lo + n_free * BLOCK_N, hi, BLOCK_N):  # tiles touching the tree or the chunk end
        pos = start + cols
        in_range = pos < hi
        offsets = _row_offsets(b, pos, in_range, bt_ptr, stride_btb, stride_kb, stride_ks, page_size, PAGED)
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


MERGE_SPLITS = 32  # the most splits per round of loads in the merge on a GPU (4 warps per 16 splits)
_MERGE_RUNTIME = ["M", "num_splits", "stride_pb", "stride_ps", "stride_lb", "stride_ls", "NT", "PER", "MB"]


@triton.jit(do_not_specialize=_MERGE_RUNTIME)
def _merge_kernel(
    part_ptr,
    plse_ptr,
    out_ptr,
    lse_ptr,
    M,
    num_splits,
    stride_pb,
    stride_ps,
    stride_lb,
    stride_ls,
    NT,
    PER,
    MB,
    D_C: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SCHED_BM: tl.constexpr = 0,
):
    """out[b, rows] = sum_s exp(lse_s - lse) * part_s, lse = logsumexp_s(lse_s).
    The splits are read BLOCK_S at a time, each group's lse and partials in one round of loads (the
    partials are not masked by their weight, which would chain each load behind its lse; a weight of
    0 is applied with a select, so an unwritten slot's NaN cannot leak), folded in online.
    SCHED_BM > 0: after the sm_90 "sched" kernel (row blocks of SCHED_BM rows, MB per request, NT tiles
    each, PER tiles per program): a row block's slots are its programs, (rb*NT + NT-1)//PER - (rb*NT)//PER
    + 1 of them; a row block with one program was written final by it and is left alone."""
    pid, b = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    n_slots = num_splits
    if SCHED_BM > 0:
        rb = b * MB + (pid * BLOCK_R) // SCHED_BM  # BLOCK_R divides SCHED_BM: one row block per program
        n_slots = (rb * NT + NT - 1) // PER - (rb * NT) // PER + 1
        row_ok = row_ok & (n_slots > 1)
    offs_dc = tl.arange(0, BLOCK_DC)
    offs_s = tl.arange(0, BLOCK_S)
    lse_base = plse_ptr + b.to(tl.int64) * stride_lb + rows[:, None] + offs_s[None, :] * stride_ls  # [BR, BS]
    part_base = (
        part_ptr
        + b.to(tl.int64) * stride_pb
        + rows[:, None, None].to(tl.int64) * D_C
        + offs_s[None, :, None].to(tl.int64) * stride_ps
        + offs_dc[None, None, :]
    )  # [BR, BS, DC]
    dc_ok = (offs_dc < D_C)[None, None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DC], tl.float32)
    for s0 in range(0, n_slots, BLOCK_S):
        ok = row_ok[:, None] & (s0 + offs_s < n_slots)[None, :]
        lse_s = tl.load(lse_base + s0 * stride_ls, mask=ok, other=float("-inf"))
        part = tl.load(part_base + s0 * stride_ps, mask=ok[:, :, None] & dc_ok, other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row no split has seen yet
        alpha = tl.exp(m - m_safe)  # 0 while m is -inf
        w = tl.exp(lse_s - m_safe[:, None])  # [BR, BS]
        acc = acc * alpha[:, None] + tl.sum(tl.where((w > 0)[:, :, None], w[:, :, None] * part, 0.0), 1)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    mask = row_ok[:, None] & (offs_dc < D_C)[None, :]
    tl.store(
        out_ptr + b.to(tl.int64) * M * D_C + rows[:, None].to(tl.int64) * D_C + offs_dc[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(lse_ptr + b.to(tl.int64) * M + rows, lse, mask=row_ok)


def pick_config(dtype: torch.dtype, rows: int, d_c: int) -> Config:
    """Launch shape by dtype and rows per request (t*h): wide M tiles feed the tensor cores when rows
    are many; narrow ones waste less when rows are few (decode); float32 keeps exact fp32 products."""
    if dtype == torch.float32:
        return Config(block_m=16, block_n=32, num_warps=4, num_stages=1)
    if rows <= 16:
        return Config(block_m=16, block_n=64, num_warps=4, num_stages=3)
    return Config(block_m=64, block_n=64, num_warps=8 if d_c >= 256 else 4, num_stages=2)


# The most splits pick_num_splits considers. 128 since the merge reads splits in rounds: at b = 1 the
# cost model then cuts a long cache into 128 (H200, 2026-12-03 ~17:29 UTC, h = 8, t = 1, b = 1: s = 32k
# 26.2 us against 29.5 with 64, s = 128k 56.8 against 80.5; s = 16k 21.2 against 21.1; b >= 2 picks as
# before, and 64 stayed the best measured there).
MAX_SPLITS = 128


@functools.lru_cache(maxsize=4096)  # host time matters: this runs once per layer per step
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


def _mask_args(visibility, ancestor_bits, causal, dummy):
    if causal:
        return MASK_CAUSAL, dummy, 0, 0
    if ancestor_bits is not None:
        return MASK_BITS, ancestor_bits, ancestor_bits.stride(0), 0
    vis = visibility.view(torch.uint8) if visibility.dtype == torch.bool else visibility
    return MASK_VISIBILITY, vis, vis.stride(0), vis.stride(1)


def _sm90_ok(
    q: torch.Tensor, kv_cache: torch.Tensor, d_v: int, rows: int, variant: str | None = None
) -> bool:
    """The sm_90 kernels need Hopper, their shapes, and 16-byte aligned cache rows and queries; unless a
    variant is pinned, also more than 16 query rows per request (fewer: the Triton kernel's 16-row
    blocks waste less)."""
    from . import mla_attention_sm90 as sm90

    aligned = kv_cache.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0
    aligned = aligned and kv_cache.stride(0) % 8 == 0 and kv_cache.stride(1) % 8 == 0
    return aligned and sm90.applies(q, d_v) and (variant is not None or rows > 16)


def tree_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    visibility: torch.Tensor | None,
    softmax_scale: float,
    d_v: int,
    block_table: torch.Tensor | None = None,
    *,
    ancestor_bits: torch.Tensor | None = None,
    causal: bool = False,
    max_seqlen: int | None = None,
    config: Config | None = None,
    num_splits: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, t, h, d] bf16/fp16/fp32; kv_cache [b, s_max, d] or [pages, page_size, d] with block_table
    [b, max_pages] int; cache_seqlens [b] int (prefix + t); visibility [b, t, t] bool, or ancestor_bits
    [b, t] int64, or causal=True. Returns out [b, t, h, d_v] in q's dtype and lse [b, t, h] float32.
    max_seqlen: a bound on cache_seqlens (else the capacity is used); it steers the split count, and
    the sm_90 "roles" / "pipe" / "sched" schedule covers exactly cdiv(max_seqlen, tile) tiles per row
    block (tile 64 or 128), so it must not be below a real length (the public op passes the maximum).
    backend: "triton" (this module's kernel for everything), "sm90" (the Gluon kernels of
    mla_attention_roles and mla_attention_sm90; Hopper, bf16/fp16, d = 512 + 64, t*h > 16 only: by
    default the "roles" kernel, the whole tree attention in one balanced launch, one warpgroup on the
    scores and softmax and one on half of P V ("sched" where the cache is not contiguous or its pages
    are not a multiple of 64 rows), or for causal calls the "wide" prefix kernel for the whole prefix
    tiles and this module's kernel for the rest; "sm90-roles" / "sm90-pipe" / "sm90-sched" /
    "sm90-double" / "sm90-wide" pick the variant) or "auto" (sm90 where it applies and no config is
    forced)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    b, t, h, d = q.shape
    rows = t * h
    q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    paged = block_table is not None
    capacity = block_table.shape[1] * kv_cache.shape[1] if paged else kv_cache.shape[1]
    sm90 = backend.startswith("sm90") or (backend == "auto" and config is None)
    variant = backend[5:] if backend.startswith("sm90-") else None
    sm90 = sm90 and _sm90_ok(q, kv_cache, d_v, rows, variant)
    if backend.startswith("sm90") and not sm90:
        raise ValueError(
            f"backend: {backend!r} needs a compute capability 9.x GPU, bf16/fp16, d = 512 + 64"
            + ("" if variant else ", t*h > 16 (or a pinned variant such as 'sm90-sched')")
        )
    cfg = config or pick_config(q.dtype, rows, d_v)
    m_blocks = triton.cdiv(rows, cfg.block_m)
    slots = multiprocessors(q.get_device()) if num_splits is None else 0  # -1 on the CPU
    out = torch.empty(b, t, h, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, t, h, dtype=torch.float32, device=q.device)
    mode, vis, svb, svi = _mask_args(visibility, ancestor_bits, causal, cache_seqlens)
    bt = block_table if paged else cache_seqlens
    page_size = kv_cache.shape[1] if paged else 1
    qk_scale = softmax_scale * LOG2E
    common = dict(
        D_C=d_v, D_R=d - d_v, BLOCK_DC=triton.next_power_of_2(d_v),
        BLOCK_DR=max(16, triton.next_power_of_2(max(d - d_v, 1))),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGED=paged,
        MASK_MODE=mode, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if sm90:
        from . import mla_attention_sm90 as fast

        chosen = variant or fast.DEFAULT_VARIANT
        if chosen in ("pipe", "sched", "roles") and not causal:
            from . import mla_attention_roles as roles

            if not fast.pipe_applies(kv_cache, paged):  # no TMA boxes (e.g. pages of 1): "sched"
                chosen = "sched"
            blocks = triton.cdiv(rows, fast.BLOCK_M)
            unit = fast.tile_rows(chosen)
            tiles = triton.cdiv(max_seqlen or capacity, unit)
            programs, per, n_slots, tiles = fast.schedule(b, blocks, tiles, slots, num_splits)
            part, plse = out, lse  # not written when no row block is cut
            if n_slots:
                part = torch.empty(b, n_slots, rows, d_v, dtype=torch.float32, device=q.device)
                plse = torch.empty(b, n_slots, rows, dtype=torch.float32, device=q.device)
            launch = {"pipe": fast.launch_pipe, "sched": fast.launch_sched, "roles": roles.launch}[chosen]
            launch(q, kv_cache, cache_seqlens, bt, vis, mode, svb, svi, out, lse, part, plse, t, h, rows,
                   qk_scale, paged, page_size, programs, per, tiles)  # fmt: skip
            if n_slots:
                _merge(part, plse, out, lse, rows, n_slots, d_v, sched=(tiles, per, blocks, fast.BLOCK_M))
            return out, lse
        if variant in (None, "pipe", "sched", "roles"):  # causal: these kernels have no causal mask
            variant = "wide"
        if num_splits is None:
            sm90_cfg = Config(block_m=fast.BLOCK_M, block_n=fast.tile_rows(variant), num_warps=8)
            m90 = triton.cdiv(rows, fast.BLOCK_M)
            num_splits = pick_num_splits(b, m90, max_seqlen or capacity, sm90_cfg, d_v, d, slots)
        part = torch.empty(b, num_splits + 1, rows, d_v, dtype=torch.float32, device=q.device)
        plse = torch.empty(b, num_splits + 1, rows, dtype=torch.float32, device=q.device)
        fast.launch_prefix(q, kv_cache, cache_seqlens, bt, part, plse, t, rows, num_splits, qk_scale, paged,
                           page_size, variant)  # fmt: skip
        _split_kv_kernel[(m_blocks, 1, b)](
            q, kv_cache, cache_seqlens, vis, bt, part, plse,
            t, h, rows, num_splits, qk_scale, page_size,
            q.stride(0), kv_cache.stride(0), kv_cache.stride(1), bt.stride(0), svb, svi,
            part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
            TAIL_UNIT=fast.tile_rows(variant), **common,
        )  # fmt: skip
        _merge(part, plse, out, lse, rows, num_splits + 1, d_v)
        return out, lse
    if num_splits is None:
        num_splits = pick_num_splits(b, m_blocks, max_seqlen or capacity, cfg, d_v, d, slots)
    if num_splits == 1:
        part, plse, sob, sos, slb, sls = out, lse, rows * d_v, 0, rows, 0
    else:
        part = torch.empty(b, num_splits, rows, d_v, dtype=torch.float32, device=q.device)
        plse = torch.empty(b, num_splits, rows, dtype=torch.float32, device=q.device)
        sob, sos, slb, sls = part.stride(0), part.stride(1), plse.stride(0), plse.stride(1)
    _split_kv_kernel[(m_blocks, num_splits, b)](
        q, kv_cache, cache_seqlens, vis, bt, part, plse,
        t, h, rows, num_splits, qk_scale, page_size,
        q.stride(0), kv_cache.stride(0), kv_cache.stride(1), bt.stride(0), svb, svi, sob, sos, slb, sls,
        **common,
    )  # fmt: skip
    if num_splits > 1:
        _merge(part, plse, out, lse, rows, num_splits, d_v)
    return out, lse


def _merge(part, plse, out, lse, rows, splits, d_v, sched=(0, 1, 0, 0)):
    """sched: (NT, PER, MB, BM) of the sm_90 "sched" launch (see _merge_kernel), else plain splits.
    On a GPU one row per program (the most programs in flight) and up to MERGE_SPLITS splits per round
    of loads, with a warp per 4 of them (at least 2: 64 partial values per thread at d_c = 512). H200,
    2026-12-03 17:19 UTC, the merge alone against the loop over single splits it replaced: 64 splits of
    8 rows 8.4 against 44.9 us, 128 splits of 64 rows 15.0 against 99.7, 8 splits of 8 rows (b = 16)
    5.8 against 10.8; 2-4 splits unchanged. The CPU interpreter keeps 16-row programs and 4 splits per
    round (fewer steps; several rounds in the CPU tests)."""
    if part.is_cuda:
        block_r, cap = 1, MERGE_SPLITS
    else:
        block_r, cap = 16, 4
    block_s = min(triton.next_power_of_2(max(splits, 1)), cap)
    warps = max(2, block_s // 4) if part.is_cuda else 4
    nt, per, mb, bm = sched
    _merge_kernel[(triton.cdiv(rows, block_r), part.shape[0])](
        part, plse, out, lse, rows, splits, part.stride(0), part.stride(1), plse.stride(0),
        plse.stride(1), nt, per, mb, D_C=d_v, BLOCK_DC=triton.next_power_of_2(d_v), BLOCK_R=block_r,
        BLOCK_S=block_s, SCHED_BM=bm, num_warps=warps,
    )  # fmt: skip
