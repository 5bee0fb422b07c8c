"""The log-sum-exp merge of partial attention outputs: out = sum_s exp(lse_s - lse) * part_s with
lse = logsumexp_s(lse_s), for the rows whose KV range was cut into several pieces.

Two layouts, one fold:
- split-KV (the Triton kernel): part [b, S, M, d_c], plse [b, S, M], every row has S pieces;
- scheduled (the Hopper kernel): program c of the schedule writes at most two float32 pieces, slot
  2c for the first row block it meets and 2c + 1 for its last, each [BM, d_c] (plse [BM]); a row
  block is cut iff a program boundary falls strictly inside it, and then its pieces are the slots of
  the programs that met it. At most min(row blocks, programs - 1) row blocks are cut (fewer tiles
  per program than per row block needs fewer row blocks than programs), which sizes the grid. The
  schedule (NT tiles per row block, PER tiles per program, units, programs per plane) is read from the
  device, so the merge needs no host value of the lengths.
Pieces are read BLOCK_S at a time, each group's lse and partials in one round of loads, folded in
online. A piece that saw nothing has lse -inf; its weight 0 is applied with a select, so NaN in its
(unwritten) partial cannot leak.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels import mla_attention_schedule as schedule
from kdtree_engine.kernels._align import aligned, stride_align
from kdtree_engine.kernels._pdl import wait_then_release

MERGE_SPLITS = 32  # the most pieces per round of loads on a GPU (a warp per 4 of them)


@triton.jit
def _fold(m, total, acc, lse_s, part):
    """One round: lse_s [BR, BS] and part [BR, BS, DC] into the running (max, sum of weights, sum)."""
    m_new = tl.maximum(m, tl.max(lse_s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row no piece has seen yet
    alpha = tl.exp(m - m_safe)  # 0 while m is -inf
    w = tl.exp(lse_s - m_safe[:, None])  # [BR, BS]
    acc = acc * alpha[:, None] + tl.sum(tl.where((w > 0)[:, :, None], w[:, :, None] * part, 0.0), 1)
    return m_new, total * alpha + tl.sum(w, 1), acc


@triton.jit
def _store(m, total, acc, out_ptrs, lse_ptrs, row_ok, dc_ok):
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None] & dc_ok[None, :])
    tl.store(lse_ptrs, lse, mask=row_ok)


_SPLIT_RUNTIME = ["M", "num_splits", "stride_pb", "stride_ps", "stride_lb", "stride_ls"]


@triton.jit(do_not_specialize=_SPLIT_RUNTIME)
def _merge_splits_kernel(part_ptr, plse_ptr, out_ptr, lse_ptr, M, num_splits, stride_pb, stride_ps, stride_lb,
                         stride_ls, D_C: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_S: tl.constexpr, ALIGN: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Program (r, b): rows r * BLOCK_R .. of request b; stride_pb and stride_ps multiples of ALIGN."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    stride_pb, stride_ps = aligned(stride_pb, ALIGN), aligned(stride_ps, ALIGN)
    pid, b = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    offs_dc = tl.arange(0, BLOCK_DC)
    offs_s = tl.arange(0, BLOCK_S)
    dc_ok = offs_dc < D_C
    lse_base = plse_ptr + b.to(tl.int64) * stride_lb + rows[:, None] + offs_s[None, :] * stride_ls  # [BR, BS]
    part_base = (
        part_ptr
        + b.to(tl.int64) * stride_pb
        + rows[:, None, None].to(tl.int64) * D_C
        + offs_s[None, :, None].to(tl.int64) * stride_ps
        + offs_dc[None, None, :]
    )  # [BR, BS, DC]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DC], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok = row_ok[:, None] & (s0 + offs_s < num_splits)[None, :]
        lse_s = tl.load(lse_base + s0 * stride_ls, mask=ok, other=float("-inf"))
        part = tl.load(part_base + s0 * stride_ps, mask=ok[:, :, None] & dc_ok[None, None, :], other=0.0)
        m, total, acc = _fold(m, total, acc, lse_s, part)
    out_ptrs = out_ptr + b.to(tl.int64) * M * D_C + rows[:, None].to(tl.int64) * D_C + offs_dc[None, :]
    _store(m, total, acc, out_ptrs, lse_ptr + b.to(tl.int64) * M + rows, row_ok, dc_ok)


@triton.jit(do_not_specialize=["M", "B", "NT", "PER", "UNITS", "GROUPS"])
def _merge_pieces_kernel(part_ptr, plse_ptr, out_ptr, lse_ptr, sched_ptr, NT, PER, UNITS, GROUPS, M, B,
                         D_C: tl.constexpr, BLOCK_DC: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_S: tl.constexpr, SCHED_ON_DEVICE: tl.constexpr,
                         PDL: tl.constexpr = False):  # fmt: skip
    """Program (j, r): rows r * BLOCK_R .. of the j-th row block that may be cut. With fewer tiles per
    program than per row block (PER < NT) every row block is cut: j is the row block; otherwise a row
    block holds at most one program boundary: j is the boundary (program j's last unit), and cuts the
    block it falls inside. Row blocks are numbered plane by plane (mla_attention_schedule)."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    j = tl.program_id(0)
    nt, per, n_units, groups = NT, PER, UNITS, GROUPS  # the schedule from the host, or:
    if SCHED_ON_DEVICE:
        nt = tl.load(sched_ptr)
        per = tl.load(sched_ptr + 1)
        n_units = tl.load(sched_ptr + 2)
        groups = tl.load(sched_ptr + 4)
    plane = B * nt
    at = schedule.program_units_jit(j, per, n_units, plane, groups)[1]
    rb = tl.where(per < nt, j, at // nt)
    if (per < nt) | ((at < n_units) & (at % nt != 0)):
        b, blk = rb % B, rb // B
        first = tl.where(groups > 0, b * nt, rb * nt)  # the block's first unit in its program numbering
        c0 = tl.where(groups > 0, blk * groups, 0) + first // per
        n = (first + nt - 1) // per - first // per + 1  # programs that met row block rb: its pieces
        local = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] rows inside the block
        rows = blk * BM + local
        row_ok = (local < BM) & (rows < M)
        offs_dc = tl.arange(0, BLOCK_DC)
        offs_s = tl.arange(0, BLOCK_S)
        dc_ok = offs_dc < D_C
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DC], tl.float32)
        for s0 in range(0, n, BLOCK_S):
            c = c0 + s0 + offs_s  # [BS] programs
            u0 = schedule.program_units_jit(c, per, n_units, plane, groups)[0]
            slot = (2 * c + (u0 // nt != rb).to(tl.int32)).to(tl.int64) * BM
            ok = row_ok[:, None] & (s0 + offs_s < n)[None, :]
            lse_s = tl.load(plse_ptr + slot[None, :] + local[:, None], mask=ok, other=float("-inf"))
            ptrs = part_ptr + (slot[None, :, None] + local[:, None, None]) * D_C + offs_dc[None, None, :]
            part = tl.load(ptrs, mask=ok[:, :, None] & dc_ok[None, None, :], other=0.0)
            m, total, acc = _fold(m, total, acc, lse_s, part)
        out_ptrs = out_ptr + b.to(tl.int64) * M * D_C + rows[:, None].to(tl.int64) * D_C + offs_dc[None, :]
        _store(m, total, acc, out_ptrs, lse_ptr + b.to(tl.int64) * M + rows, row_ok, dc_ok)


def _round_shape(pieces: int, on_gpu: bool) -> tuple[int, int, int]:
    """(rows per program, pieces per round, warps): on a GPU one row per program (the most programs in
    flight) and up to MERGE_SPLITS pieces per round, a warp per 4 (at least 2: 64 partial values per
    thread at d_c = 512); the CPU interpreter takes 16 rows and 4 pieces (fewer steps)."""
    if not on_gpu:
        return 16, min(triton.next_power_of_2(max(pieces, 1)), 4), 4
    block_s = min(triton.next_power_of_2(max(pieces, 1)), MERGE_SPLITS)
    return 1, block_s, max(2, block_s // 4)


def merge_splits(
    part: torch.Tensor, plse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, fixed_rounds: bool = False
) -> None:
    """part [b, S, M, d_c] float32, plse [b, S, M] -> out [b, M, d_c] (its dtype), lse [b, M] float32.
    fixed_rounds: fold as many pieces per round whatever S is (the row-invariant mode: a row's sum then
    groups its pieces the same way in every launch; pieces past its last one are exact no-ops)."""
    b, splits, rows, d_c = part.shape
    block_r, block_s, warps = _round_shape(MERGE_SPLITS if fixed_rounds else splits, part.is_cuda)
    _merge_splits_kernel[(triton.cdiv(rows, block_r), b)](
        part, plse, out, lse, rows, splits, part.stride(0), part.stride(1), plse.stride(0), plse.stride(1),
        D_C=d_c, BLOCK_DC=triton.next_power_of_2(d_c), BLOCK_R=block_r, BLOCK_S=block_s,
        ALIGN=stride_align(part.element_size(), part.stride(0), part.stride(1)), num_warps=warps,
        **pdl.launch(part.device),
    )  # fmt: skip


def merge_pieces(
    part, plse, out, lse, sched, rows: int, block_m: int, cut_blocks: int, max_pieces: int
) -> None:
    """The scheduled layout: part [2 * programs, block_m, d_c] float32, plse [2 * programs, block_m],
    sched (NT, PER, units, programs, groups): a Schedule from the host, or int32 [5] on the device;
    out [b, rows, d_c], lse [b, rows] get the cut row blocks. cut_blocks bounds how many row blocks are
    cut (the grid); max_pieces bounds the pieces of one row block (sizes the rounds)."""
    d_c = part.shape[2]
    block_r, block_s, warps = _round_shape(max_pieces, part.is_cuda)
    on_device = isinstance(sched, torch.Tensor)
    nt, per, units, _, groups = (0, 0, 0, 0, 0) if on_device else sched
    _merge_pieces_kernel[(max(cut_blocks, 1), triton.cdiv(block_m, block_r))](
        part, plse, out, lse, sched if on_device else plse, nt, per, units, groups, rows, out.shape[0],
        D_C=d_c, BLOCK_DC=triton.next_power_of_2(d_c), BM=block_m, BLOCK_R=block_r, BLOCK_S=block_s,
        SCHED_ON_DEVICE=on_device, num_warps=warps,
        **pdl.launch(part.device),
    )  # fmt: skip
