"""The Hopper kernel's balanced schedule: which (row block, tile) units each persistent program takes.

The work of a forward is b * MB row blocks (64 query rows each) of NT tiles (64 cache slots each), one
unit per (row block, tile), NT covering the longest request. Units are numbered plane by plane: plane
m holds row block m of every request, so row block (request r, block m) is rb = m * b + r and its
units are rb * NT .. rb * NT + NT - 1. A plane has P = b * NT units. Two layouts of programs:
- flat (groups = 0): program c takes units c * PER .. c * PER + PER - 1;
- aligned (groups = G > 0): program c takes units c0 .. c0 + PER - 1 of plane c // G, c0 being
  (c % G) * PER, clipped to the plane. Programs c, c + G, c + 2G, ... cover the same requests' same
  tiles in row blocks 0, 1, 2, ...: they run at the same time, so each tile comes from DRAM once and
  from the L2 for the other row blocks (h = 8, t = 17 has 3 row blocks: otherwise 3 DRAM reads).
`schedule` is the specification, in Python; `device_schedule` computes the same numbers on the device
from the lengths (one tiny launch per forward, no host read), so a captured forward replays it for new
lengths. Rules:
- balanced: PER = max(cdiv(units, programs), min(NT, MIN_TILES)); when that is at least 4 row blocks,
  whole row blocks (imbalance <= 1/4, no cut, no merge);
- aligned when a request has several row blocks: G = multiprocessors // MB programs per plane and PER
  balanced over a plane's units (the same rounding to whole row blocks), kept when it is at most
  ALIGN_SLACK of the flat PER (the multiprocessors past MB * G stay idle);
- forced (tests): each row block cut into `forced` runs, flat.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release

MIN_TILES = 4  # a program's least share of a long request (its Q load and partial store amortized)
ALIGN_SLACK = (11, 10)  # the aligned PER may be at most 11/10 of the flat one
_MIN_TILES = tl.constexpr(MIN_TILES)
_SLACK_NUM, _SLACK_DEN = tl.constexpr(ALIGN_SLACK[0]), tl.constexpr(ALIGN_SLACK[1])
FIELDS = 5  # the numbers of a schedule, as the device holds them


class Schedule(NamedTuple):
    tiles: int  # NT: tiles per row block (those of the longest request)
    per: int  # PER: tiles per program
    units: int  # b * MB * NT
    programs: int  # programs with work (aligned: MB * G, some of them maybe without)
    groups: int  # G: programs per plane when aligned, 0 when flat

    def cuts(self) -> bool:
        """Whether some row block is covered by several programs (then partials and a merge)."""
        return self.per % self.tiles != 0 and (self.groups if self.groups else self.programs) > 1


def _balanced(units: int, tiles: int, programs: int) -> int:
    """PER for `units` over `programs`: at least min(tiles, MIN_TILES), whole row blocks from 4 up."""
    per = max(triton.cdiv(units, max(programs, 1)), min(tiles, MIN_TILES))
    return triton.cdiv(per, tiles) * tiles if per >= 4 * tiles else per


def schedule(b: int, blocks: int, tiles: int, sms: int, forced: int = 0) -> Schedule:
    """b requests of `blocks` row blocks of `tiles` tiles each, over `sms` programs."""
    tiles = max(tiles, 1)
    units = b * blocks * tiles
    if forced:
        per = triton.cdiv(tiles, forced)
        return Schedule(tiles, per, units, triton.cdiv(units, per), 0)
    per = _balanced(units, tiles, sms)
    groups = sms // blocks
    if blocks > 1 and groups >= 1:
        aligned = _balanced(b * tiles, tiles, groups)
        if aligned * ALIGN_SLACK[1] <= per * ALIGN_SLACK[0]:
            groups = triton.cdiv(b * tiles, aligned)
            return Schedule(tiles, aligned, units, blocks * groups, groups)
    return Schedule(tiles, per, units, triton.cdiv(units, per), 0)


def program_units(s: Schedule, b: int, c: int) -> tuple[int, int]:
    """(u0, u1): program c's units u0 .. u1 - 1 under schedule s of b requests (u0 == u1: none)."""
    if not s.groups:
        return min(c * s.per, s.units), min(c * s.per + s.per, s.units)
    plane = b * s.tiles
    base, lo = (c // s.groups) * plane, (c % s.groups) * s.per
    return min(base + min(lo, plane), s.units), min(base + min(lo + s.per, plane), s.units)


def row_block(rb: int, b: int) -> tuple[int, int]:
    """(request, block of the request) of row block rb (plane-major numbering)."""
    return rb % b, rb // b


def max_pieces(b: int, blocks: int, sms: int, forced: int = 0) -> int:
    """A bound on the programs that meet one row block, whatever the lengths (sizes the merge)."""
    return forced + 1 if forced else sms // (b * blocks) + 2


def cut_blocks(b: int, blocks: int, programs: int, forced: int = 0) -> int:
    """A bound on the row blocks a schedule of `programs` programs cuts: every row block when forced,
    else min(row blocks, programs - 1) (PER < NT, where every row block is cut, needs b * blocks <
    programs; otherwise each boundary between programs cuts at most one row block)."""
    return b * blocks if forced else min(b * blocks, programs - 1)


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _balanced_per(units, tiles, programs):
    per = tl.maximum(_cdiv(units, tl.maximum(programs, 1)), tl.minimum(tiles, _MIN_TILES))
    if per >= 4 * tiles:
        per = _cdiv(per, tiles) * tiles
    return per


@triton.jit(do_not_specialize=["B", "MB", "SMS", "FORCED"])
def _schedule_kernel(
    seqlens_ptr,
    sched_ptr,
    B,
    MB,
    SMS,
    FORCED,
    BN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """sched_ptr [5] int32 <- schedule(B, MB, cdiv(max seqlens, BN), SMS, FORCED) (tiles, per, units,
    programs, groups); one program, the same integer arithmetic as `schedule`."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    longest = B * 0
    for b0 in range(0, B, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        longest = tl.maximum(
            longest, tl.max(tl.load(seqlens_ptr + offs, mask=offs < B, other=0).to(tl.int32))
        )
    tiles = tl.maximum(_cdiv(longest, BN), 1)
    units = B * MB * tiles
    groups = B * 0
    if FORCED > 0:
        per = _cdiv(tiles, FORCED)
    else:
        per = _balanced_per(units, tiles, SMS)
        if (MB > 1) & (SMS // MB >= 1):
            aligned = _balanced_per(B * tiles, tiles, SMS // MB)
            if aligned * _SLACK_DEN <= per * _SLACK_NUM:
                per = aligned
                groups = _cdiv(B * tiles, aligned)
    tl.store(sched_ptr, tiles)
    tl.store(sched_ptr + 1, per)
    tl.store(sched_ptr + 2, units)
    tl.store(sched_ptr + 3, tl.where(groups > 0, MB * groups, _cdiv(units, per)))
    tl.store(sched_ptr + 4, groups)


def device_schedule(seqlens: torch.Tensor, blocks: int, sms: int, tile: int, forced: int = 0) -> torch.Tensor:
    """int32 [FIELDS] on seqlens' device: `schedule` of this forward (tiles, per, units, programs, groups)."""
    sched = torch.empty(FIELDS, dtype=torch.int32, device=seqlens.device)
    b = seqlens.shape[0]
    block_b = min(triton.next_power_of_2(max(b, 1)), 1024)
    _schedule_kernel[(1,)](
        seqlens, sched, b, blocks, sms, forced, BN=tile, BLOCK_B=block_b, **pdl.launch(seqlens.device)
    )
    return sched


@triton.jit
def program_units_jit(c, per, n_units, plane, groups):
    """(u0, u1) of program(s) c, as `program_units` (plane = b * NT)."""
    g = tl.maximum(groups, 1)
    base = (c // g) * plane
    lo = (c - (c // g) * g) * per
    u0 = tl.where(groups > 0, base + tl.minimum(lo, plane), c * per)
    u1 = tl.where(groups > 0, base + tl.minimum(lo + per, plane), c * per + per)
    return tl.minimum(u0, n_units), tl.minimum(u1, n_units)
