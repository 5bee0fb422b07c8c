"""The sm_90 "sched" launch's schedule and its scheduled-mode merge, on the CPU.

The Gluon kernel itself runs only on Hopper (its numerics: test_mla_attention.py, gpu marker; its
build: test_mla_attention_sm90_compile.py). Here a torch emulation writes exactly what each program
of the schedule writes (a final row block, or float32 partial slot c - (rb*NT)//PER of a cut one,
lse -inf for a run with no slot), and the real merge kernel (Triton interpreter in CI) must turn it
into the reference attention."""

from __future__ import annotations

import pytest
import torch
from test_mla_attention import assert_close, make_inputs  # same folder (no package)

from kdtree_engine.kernels import mla_attention as kernels
from kdtree_engine.kernels import mla_attention_sm90 as sm90
from kdtree_engine.ref import mla_attention as ref

BN = 8  # tile slots of the emulation (the kernel's 128, shrunk to keep shapes small)


def partial_attention(q, kv, length, vis, scale, d_c, lo, hi):
    """Rows [t*h] of one request over cache slots lo .. hi - 1 (tree mask on the last t): (out, lse)."""
    t, h, _ = q.shape
    hi = min(hi, length)
    if hi <= lo:
        nothing = torch.full((t * h,), float("-inf"), dtype=torch.float64)
        return torch.zeros(t * h, d_c, dtype=torch.float64), nothing
    pos = torch.arange(lo, hi)
    j = pos - (length - t)
    allowed = (j < 0)[None, :] | vis[:, j.clamp(min=0)] & (j >= 0)[None, :]  # [t, s]
    scores = torch.einsum("thd,sd->ths", q.double(), kv[lo:hi].double()) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf")).reshape(t * h, -1)
    lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return p @ kv[lo:hi, :d_c].double(), lse


def emulate(q, kv, lengths, vis, scale, d_c, blocks, tiles, per, programs, n_slots):
    b, t, h, _ = q.shape
    rows = t * h
    out = torch.zeros(b, rows, d_c, dtype=torch.float64)
    lse = torch.zeros(b, rows, dtype=torch.float64)
    part = torch.full((b, max(n_slots, 1), rows, d_c), float("nan"), dtype=torch.float32)
    plse = torch.full((b, max(n_slots, 1), rows), float("nan"), dtype=torch.float32)  # unwritten: NaN
    units = b * blocks * tiles
    for c in range(programs):
        u0, u1 = c * per, min(c * per + per, units)
        for rb in range(u0 // tiles, (u1 - 1) // tiles + 1):
            r, blk = divmod(rb, blocks)
            v_lo, v_hi = max(u0 - rb * tiles, 0), min(u1 - rb * tiles, tiles)
            o, l = partial_attention(q[r], kv[r], int(lengths[r]), vis[r], scale, d_c, v_lo * BN, v_hi * BN)
            sl = slice(blk * sm90.BLOCK_M, min((blk + 1) * sm90.BLOCK_M, rows))
            if v_lo == 0 and v_hi == tiles:
                out[r, sl], lse[r, sl] = o[sl], l[sl]
            else:
                slot = c - (rb * tiles) // per
                assert 0 <= slot < n_slots, (c, rb, slot, n_slots)
                part[r, slot, sl], plse[r, slot, sl] = o[sl].float(), l[sl].float()
    return out, lse, part, plse


@pytest.mark.parametrize(
    "b,t,h,prefixes,splits,sms",
    [
        (3, 9, 16, [0, 40, 17], None, 4),  # balanced over 4 programs: blocks cut mid-way
        (2, 5, 32, [70, 3], None, 132),  # more programs than work: per = MIN_TILES
        (2, 9, 8, [30, 60], 2, 0),  # each block in 2 runs
        (1, 33, 4, [100], 5, 0),  # runs spanning block edges (per does not divide tiles)
        (4, 2, 64, [5, 9, 0, 33], None, 1),  # one program: whole blocks, no merge
        (2, 9, 8, [150, 23], None, 13),  # aligned: both row blocks of a request cut at the same tiles
        (5, 5, 16, [61, 200, 0, 7, 120], None, 11),  # aligned, one run per row block: whole blocks, no merge
        (1, 2, 32, [200], None, 13),  # one row block in 7 runs: the merge reads its slots in several rounds
        (2, 2, 32, [200, 60], None, 13),  # the same, the second request's runs past its end empty
    ],
)
def test_schedule_and_scheduled_merge(b, t, h, prefixes, splits, sms):
    gen = torch.Generator().manual_seed(b * 100 + t)
    q, kv, lengths, vis, _, _ = make_inputs(b, t, h, 24, 8, prefixes, torch.float32, None, "random", gen)
    kv = kv.nan_to_num(0.0)  # slots past the lengths are never part of a run here
    d_c, scale = 24, 0.3
    rows = t * h
    blocks, need = -(-rows // sm90.BLOCK_M), -(-int(lengths.max()) // BN)
    programs, per, n_slots, tiles = sm90.schedule(b, blocks, need, sms, splits)
    assert tiles >= need and (programs - 1) * per < b * blocks * tiles <= programs * per
    if per % tiles == 0:
        assert n_slots == 0
    out, lse, part, plse = emulate(q, kv, lengths, vis, scale, d_c, blocks, tiles, per, programs, n_slots)
    final_out, final_lse = out.float().clone(), lse.float().clone()
    if n_slots:
        sched = (tiles, per, blocks, sm90.BLOCK_M)
        kernels._merge(part, plse, final_out, final_lse, rows, n_slots, d_c, sched=sched)
    want_out, want_lse = ref.tree_mla_attention(q, kv, lengths, vis, scale, d_c)
    assert_close("out", final_out.view(b, t, h, d_c), want_out, 1e-4)
    assert_close("lse", final_lse.view(b, t, h), want_lse, 1e-4)


def test_schedule_is_balanced():
    # Kimi verify at b = 16, t = 9, h = 64, s = 4k on 132 multiprocessors: 144 row blocks of 33 tiles
    programs, per, n_slots, tiles = sm90.schedule(16, 9, 33, 132)
    assert programs <= 132 and per == -(-16 * 9 * 33 // 132) and n_slots == 2 and tiles == 33
    # many row blocks per program: whole blocks, no partials
    programs, per, n_slots, tiles = sm90.schedule(64, 33, 2, 132)
    assert per % 2 == 0 and n_slots == 0 and programs <= 132 and tiles == 2


@pytest.mark.parametrize(
    "b,blocks,tiles,want",
    [
        (16, 2, 513, (128, 129, 4, 516)),  # h = 8, t = 9, s = 32k: 4 runs per row block (balanced: 125)
        (16, 2, 65, (128, 17, 4, 68)),  # s = 4k (balanced: 16 tiles per program)
        (64, 2, 513, (128, 513, 0, 513)),  # one run: whole row blocks, no merge (balanced: cut at 498)
        (1, 9, 513, (126, 37, 14, 518)),  # h = 64, t = 9, b = 1 (balanced: 35)
    ],
)
def test_schedule_aligns_the_row_blocks_of_a_request(b, blocks, tiles, want):
    programs, per, n_slots, padded = sm90.schedule(b, blocks, tiles, 132)
    assert (programs, per, n_slots, padded) == want
    # runs start at the same tile in every row block: program c covers tiles (c % runs) * per onwards
    assert padded % per == 0 and programs == b * blocks * (padded // per)


@pytest.mark.parametrize("b,blocks,tiles", [(16, 2, 513), (16, 3, 200), (16, 9, 33), (40, 2, 100)])
def test_schedule_aligns_only_within_its_slack(b, blocks, tiles, monkeypatch):
    balanced_per = max(-(-b * blocks * tiles // 132), min(tiles, sm90.MIN_TILES))
    programs, per, n_slots, padded = sm90.schedule(b, blocks, tiles, 132)
    assert programs <= 132 and per <= balanced_per * (1 + sm90.ALIGN_SLACK)
    monkeypatch.setattr(sm90, "ALIGN_SLACK", -1.0)  # never aligned: the plain balanced cut
    programs, per, n_slots, padded = sm90.schedule(b, blocks, tiles, 132)
    assert padded == tiles and per == balanced_per


def test_pipe_serves_the_caches_its_tma_boxes_fit():
    """The "pipe" kernel (the "sched" schedule with TMA copies in 64 x 64 boxes) takes contiguous caches
    and pages of a multiple of 64 rows; anything else is left to "sched" (cp.async reads any page size)."""
    d = 576
    assert sm90.pipe_applies(torch.zeros(2, 300, d), paged=False)
    assert sm90.pipe_applies(torch.zeros(9, 64, d), paged=True)
    assert sm90.pipe_applies(torch.zeros(9, 128, d), paged=True)
    assert not sm90.pipe_applies(torch.zeros(9, 16, d), paged=True)
    assert not sm90.pipe_applies(torch.zeros(9, 1, d), paged=True)
    assert not sm90.pipe_applies(torch.zeros(2, 300, d)[:, ::2], paged=False)  # rows not contiguous
    assert sm90.VARIANTS["pipe"][1] == sm90.VARIANTS["sched"][1]  # one schedule, one merge for both
