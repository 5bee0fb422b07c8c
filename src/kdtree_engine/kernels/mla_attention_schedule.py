"""The Hopper kernel's balanced schedule: which (row block, tile) units each persistent program takes.

The work of a forward is b * MB row blocks (64 query rows each) of NT tiles (64 cache slots each), one
unit per (row block, tile), NT covering the longest request. Program c takes units c * PER .. c * PER
+ PER - 1. `schedule` is the specification, in Python; `device_schedule` computes the same numbers on
the device from the lengths (one tiny launch per forward, no host read), so a captured forward replays
it for new lengths. Rules:
- balanced: PER = max(cdiv(units, programs), min(NT, MIN_TILES)); when that is at least 4 row blocks,
  whole row blocks (imbalance <= 1/4, no cut, no merge);
- aligned: a request of several row blocks, each cut, has them cut at the same tiles when that costs
  at most ALIGN_SLACK of balance, so the programs of one run read the same cache tiles at about the
  same time (from the L2 after the first); its row blocks are then padded to a whole number of runs
  (tiles past a request's end are no work);
- forced (tests): each row block cut into `forced` runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs

MIN_TILES = 4  # a program's least share of a long request (its Q load and partial store amortized)
ALIGN_SLACK = (11, 10)  # an aligned cut may make PER at most 11/10 of the balanced one
_MIN_TILES = tl.constexpr(MIN_TILES)
_SLACK_NUM, _SLACK_DEN = tl.constexpr(ALIGN_SLACK[0]), tl.constexpr(ALIGN_SLACK[1])


class Schedule(NamedTuple):
    tiles: int  # NT: tiles per row block in the launch (>= the longest request's)
    per: int  # PER: tiles per program
    units: int  # b * MB * NT
    programs: int  # programs with work: cdiv(units, PER)

    def cuts(self) -> bool:
        """Whether some row block is covered by several programs (then partials and a merge)."""
        return self.per % self.tiles != 0 and self.programs > 1


def schedule(b: int, blocks: int, tiles: int, sms: int, forced: int = 0) -> Schedule:
    """b requests of `blocks` row blocks of `tiles` tiles each, over `sms` programs."""
    tiles = max(tiles, 1)
    units = b * blocks * tiles
    if forced:
        per = -(-tiles // forced)
        return Schedule(tiles, per, units, -(-units // per))
    per = max(-(-units // max(sms, 1)), min(tiles, MIN_TILES))
    if per >= 4 * tiles:
        per = -(-per // tiles) * tiles
    runs = sms // (b * blocks) if blocks > 1 and per < tiles else 0
    if runs >= 1:
        aligned = max(-(-tiles // runs), min(tiles, MIN_TILES))
        if aligned * ALIGN_SLACK[1] <= per * ALIGN_SLACK[0]:
            padded = -(-tiles // aligned) * aligned
            return Schedule(padded, aligned, b * blocks * padded, b * blocks * (padded // aligned))
    return Schedule(tiles, per, units, -(-units // per))


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


@triton.jit(do_not_specialize=["B", "MB", "SMS", "FORCED"])
def _schedule_kernel(seqlens_ptr, sched_ptr, B, MB, SMS, FORCED, BN: tl.constexpr, BLOCK_B: tl.constexpr):
    """sched_ptr [4] int32 <- schedule(B, MB, cdiv(max seqlens, BN), SMS, FORCED) (tiles, per, units,
    programs); one program, the same integer arithmetic as `schedule`."""
    longest = B * 0
    for b0 in range(0, B, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        longest = tl.maximum(
            longest, tl.max(tl.load(seqlens_ptr + offs, mask=offs < B, other=0).to(tl.int32))
        )
    tiles = tl.maximum(_cdiv(longest, BN), 1)
    units = B * MB * tiles
    if FORCED > 0:
        per = _cdiv(tiles, FORCED)
    else:
        per = tl.maximum(_cdiv(units, tl.maximum(SMS, 1)), tl.minimum(tiles, _MIN_TILES))
        if per >= 4 * tiles:
            per = _cdiv(per, tiles) * tiles
        runs = SMS * 0
        if (MB > 1) & (per < tiles):
            runs = SMS // (B * MB)
        if runs >= 1:
            aligned = tl.maximum(_cdiv(tiles, runs), tl.minimum(tiles, _MIN_TILES))
            if aligned * _SLACK_DEN <= per * _SLACK_NUM:
                tiles = _cdiv(tiles, aligned) * aligned
                per = aligned
                units = B * MB * tiles
    tl.store(sched_ptr, tiles)
    tl.store(sched_ptr + 1, per)
    tl.store(sched_ptr + 2, units)
    tl.store(sched_ptr + 3, _cdiv(units, per))


def device_schedule(seqlens: torch.Tensor, blocks: int, sms: int, tile: int, forced: int = 0) -> torch.Tensor:
    """int32 [4] on seqlens' device: `schedule` of this forward (tiles, per, units, programs)."""
    sched = torch.empty(4, dtype=torch.int32, device=seqlens.device)
    b = seqlens.shape[0]
    block_b = min(triton.next_power_of_2(max(b, 1)), 1024)
    _schedule_kernel[(1,)](seqlens, sched, b, blocks, sms, forced, BN=tile, BLOCK_B=block_b)
    return sched
