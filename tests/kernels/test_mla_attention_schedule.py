"""The Hopper kernel's schedule and the merge of its pieces, on the CPU.

The Gluon kernel runs only on Hopper (its numerics: test_mla_attention.py, gpu marker; its build:
test_mla_attention_hopper_compile.py). Here: the device schedule (Triton interpreter in CI) equals the
Python specification, and a torch emulation writes exactly what each program of a schedule writes (a
final row block, or float32 piece 2c / 2c + 1 of a cut one, lse -inf for a program with no tile of
it, NaN in every slot nobody writes), which the real merge kernel must turn into the reference."""

from __future__ import annotations

import random

import pytest
import torch
from test_mla_attention import assert_close, make_inputs  # same folder (no package)

from kdtree_engine.kernels import mla_attention_schedule as sched
from kdtree_engine.kernels.mla_attention_merge import merge_pieces
from kdtree_engine.ref import mla_attention as ref

BN = 8  # tile slots of the emulation (the kernel's 64, shrunk to keep shapes small)
BM = 64  # query rows per row block, as the kernel


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


def emulate(q, kv, lengths, vis, scale, d_c, blocks, s: sched.Schedule, grid: int):
    """What the kernel's `grid` programs write under schedule s: (out, lse, part, plse)."""
    b, t, h, _ = q.shape
    rows = t * h
    out = torch.full((b, rows, d_c), float("nan"))
    lse = torch.full((b, rows), float("nan"))
    part = torch.full((2 * grid, BM, d_c), float("nan"))
    plse = torch.full((2 * grid, BM), float("nan"))
    for c in range(grid):
        u0, u1 = sched.program_units(s, b, c)
        if u0 >= u1:
            continue  # a program with no units writes nothing
        for rb in range(u0 // s.tiles, (u1 - 1) // s.tiles + 1):
            r, blk = sched.row_block(rb, b)
            v_lo, v_hi = max(u0 - rb * s.tiles, 0), min(u1 - rb * s.tiles, s.tiles)
            o, l = partial_attention(q[r], kv[r], int(lengths[r]), vis[r], scale, d_c, v_lo * BN, v_hi * BN)
            lo, hi = blk * BM, min((blk + 1) * BM, rows)
            if v_lo == 0 and v_hi == s.tiles:
                out[r, lo:hi], lse[r, lo:hi] = o[lo:hi].float(), l[lo:hi].float()
            else:
                slot = 2 * c + (rb != u0 // s.tiles)
                part[slot, : hi - lo], plse[slot, : hi - lo] = o[lo:hi].float(), l[lo:hi].float()
    return out, lse, part, plse


@pytest.mark.parametrize(
    "b,t,h,prefixes,forced,sms",
    [
        (3, 9, 16, [0, 40, 17], 0, 4),  # balanced over 4 programs: blocks cut mid-way
        (2, 5, 32, [70, 3], 0, 132),  # more programs than work: per = MIN_TILES
        (2, 9, 8, [30, 60], 2, 0),  # each block in 2 runs
        (1, 33, 4, [100], 5, 0),  # runs spanning block edges (per does not divide tiles)
        (4, 2, 64, [5, 9, 0, 33], 0, 1),  # one program: whole blocks, no merge
        (2, 9, 8, [150, 23], 0, 13),  # aligned: both row blocks of a request cut at the same tiles
        (5, 5, 16, [61, 200, 0, 7, 120], 0, 11),  # aligned, one run per row block: whole blocks
        (5, 17, 8, [61, 200, 0, 7, 120], 0, 8),  # aligned, 3 row blocks (the last of 8 rows)
        (7, 9, 16, [40, 3, 90, 0, 66, 12, 31], 0, 5),  # aligned, 3 row blocks over 5 programs: 2 idle
        (9, 5, 16, [130, 4, 60, 0, 99, 17, 8, 121, 33], 0, 4),  # aligned, whole row blocks: 2 planes of 2
        (1, 2, 32, [200], 0, 13),  # one row block in 7 runs: the merge reads its pieces in several rounds
        (2, 2, 32, [200, 60], 0, 13),  # the same, the second request's runs past its end empty
    ],
)
@pytest.mark.parametrize("spare", [0, 3])  # programs past the schedule's (a captured grid): no work
def test_pieces_merge_into_the_reference(b, t, h, prefixes, forced, sms, spare, device):
    gen = torch.Generator().manual_seed(b * 100 + t)
    q, kv, lengths, vis, _, _ = make_inputs(b, t, h, 24, 8, prefixes, torch.float32, None, "random", gen)
    kv = kv.nan_to_num(0.0)  # slots past the lengths are never part of a run here
    d_c, scale, rows = 24, 0.3, t * h
    blocks = -(-rows // BM)
    s = sched.schedule(b, blocks, -(-int(lengths.max()) // BN), sms, forced)
    covered = [u for c in range(s.programs) for u in range(*sched.program_units(s, b, c))]
    assert sorted(covered) == list(range(s.units))  # every unit once
    grid = s.programs + spare
    out, lse, part, plse = emulate(q, kv, lengths, vis, scale, d_c, blocks, s, grid)
    assert s.cuts() or not out.isnan().any()
    device_sched = sched.device_schedule(lengths.to(device, torch.int32), blocks, sms, BN, forced)
    assert tuple(device_sched.tolist()) == tuple(s)
    cut = sched.cut_blocks(b, blocks, grid, forced)
    pieces = sched.max_pieces(b, blocks, sms, forced)
    part, plse, out, lse = (x.to(device) for x in (part, plse, out, lse))
    host_out, host_lse = out.clone(), lse.clone()
    merge_pieces(part, plse, out, lse, device_sched, rows, BM, cut, pieces)
    merge_pieces(part, plse, host_out, host_lse, s, rows, BM, cut, pieces)  # from the host
    assert torch.equal(host_out.nan_to_num(7.0), out.nan_to_num(7.0)) and torch.equal(host_lse, lse)
    out, lse = out.cpu(), lse.cpu()
    want_out, want_lse = ref.tree_mla_attention(q, kv, lengths, vis, scale, d_c)
    assert_close("out", out.view(b, t, h, d_c), want_out, 1e-4)
    assert_close("lse", lse.view(b, t, h), want_lse, 1e-4)


def test_device_schedule_equals_the_specification(device):
    """Random batches, row blocks, chip sizes and forced cuts: the device kernel's numbers are the
    Python schedule's, and no row block meets more programs than max_pieces says."""
    rng = random.Random(0)
    for _ in range(60):
        b, blocks = rng.choice([1, 2, 3, 16, 64]), rng.choice([1, 2, 3, 9, 33])
        sms, forced = rng.choice([1, 4, 11, 13, 132]), rng.choice([0, 0, 0, 2, 5])
        lengths = torch.randint(1, rng.choice([100, 5000, 40000]), (b,))
        want = sched.schedule(b, blocks, -(-int(lengths.max()) // 64), sms, forced)
        got = sched.device_schedule(lengths.to(device), blocks, sms, 64, forced)
        assert tuple(got.tolist()) == tuple(want)
        spans = [sched.program_units(want, b, c) for c in range(want.programs)]
        pieces = [sum(u0 < (rb + 1) * want.tiles and u1 > rb * want.tiles for u0, u1 in spans)
                  for rb in range(b * blocks)]  # fmt: skip
        assert max(pieces) <= sched.max_pieces(b, blocks, sms, forced)
        cut = sum(n > 1 for n in pieces)
        assert cut <= sched.cut_blocks(b, blocks, want.programs, forced)
        assert cut <= sched.cut_blocks(b, blocks, b * blocks * forced if forced else sms, forced)
        assert want.programs <= (b * blocks * forced if forced else sms)


def test_schedule_is_balanced(monkeypatch):
    # Kimi verify at b = 16, t = 9, h = 64, s = 4k on 132 multiprocessors: 144 row blocks of 33 tiles
    monkeypatch.setattr(sched, "ALIGN_SLACK", (0, 1))  # flat
    s = sched.schedule(16, 9, 33, 132)
    assert s.programs <= 132 and s.per == -(-16 * 9 * 33 // 132) and s.cuts() and s.tiles == 33
    monkeypatch.undo()  # aligned: 14 programs per plane, 126 in all, 38 tiles each (36 flat)
    assert tuple(sched.schedule(16, 9, 33, 132)) == (33, 38, 16 * 9 * 33, 126, 14)
    # many row blocks per program: whole blocks, no pieces
    s = sched.schedule(64, 33, 2, 132)
    assert s.per % 2 == 0 and not s.cuts() and s.programs <= 132 and s.tiles == 2


def aligned_runs(s: sched.Schedule, b: int, blocks: int) -> list[set]:
    """Per program group g: the in-plane unit ranges its programs take in each plane."""
    plane = b * s.tiles
    spans = [
        [sched.program_units(s, b, blk * s.groups + g) for blk in range(blocks)] for g in range(s.groups)
    ]
    return [{(u0 - blk * plane, u1 - blk * plane) for blk, (u0, u1) in enumerate(runs)} for runs in spans]


@pytest.mark.parametrize(
    "b,blocks,tiles,want",
    [
        (16, 2, 513, (513, 125, 16 * 2 * 513, 2 * 66, 66)),  # h = 8, t = 9, s = 32k: 125 tiles a program
        (16, 3, 65, (65, 24, 16 * 3 * 65, 3 * 44, 44)),  # h = 8, t = 17, s = 4k: 3 planes of 44 programs
        (64, 3, 65, (65, 95, 64 * 3 * 65, 3 * 44, 44)),  # the same at b = 64 (a run spans 2 requests)
        (64, 2, 513, (513, 498, 64 * 2 * 513, 2 * 66, 66)),  # b = 64, s = 32k: most row blocks cut
        (1, 9, 513, (513, 37, 9 * 513, 9 * 14, 14)),  # h = 64, t = 9, b = 1 (126 programs)
    ],
)
def test_schedule_aligns_the_row_blocks_of_a_request(b, blocks, tiles, want):
    s = sched.schedule(b, blocks, tiles, 132)
    assert tuple(s) == want
    # program g of every plane takes the same units of its plane: the same requests' same tiles
    assert all(len(runs) == 1 for runs in aligned_runs(s, b, blocks))


@pytest.mark.parametrize(
    "b,blocks,tiles", [(16, 2, 513), (16, 3, 200), (16, 9, 33), (40, 2, 100), (16, 17, 65)]
)
def test_schedule_aligns_only_within_its_slack(b, blocks, tiles, monkeypatch):
    balanced_per = max(-(-b * blocks * tiles // 132), min(tiles, sched.MIN_TILES))
    s = sched.schedule(b, blocks, tiles, 132)
    num, den = sched.ALIGN_SLACK
    assert s.programs <= 132 and s.per * den <= balanced_per * num
    monkeypatch.setattr(sched, "ALIGN_SLACK", (0, 1))  # never aligned: the plain balanced cut
    s = sched.schedule(b, blocks, tiles, 132)
    assert s.groups == 0 and s.tiles == tiles and s.per == balanced_per


def test_each_kernel_module_plans_from_the_bounds_it_reads():
    """plan_attention hands both kernel modules the same LaunchBounds; the Hopper module plans from the
    trusted max_seqlen and the forced splits, the Triton module from the steering length over the device's
    multiprocessors (bounds chosen so that reading the wrong field gives another launch)."""
    from kdtree_engine.attention import plan_attention
    from kdtree_engine.kernels import mla_attention_hopper as hopper
    from kdtree_engine.kernels import mla_attention_triton as triton_attn
    from kdtree_engine.kernels.mla_attention_args import LaunchBounds

    b, t, h = 3, 9, 8
    q, kv, lengths, vis, _, _ = make_inputs(b, t, h, 24, 8, [100, 121, 77], torch.float32, None, "random",
                                            torch.Generator().manual_seed(5))  # fmt: skip
    plan = plan_attention(q, kv, lengths, softmax_scale=0.3, d_v=24, visibility=vis, impl="triton")
    p, cpu = plan.problem, torch.device("cpu")
    bounds = LaunchBounds(max_seqlen=int(lengths.max()), steer=40000, num_splits=2, invariant=False)
    got = hopper.plan_launch(p, q.dtype, cpu, bounds)
    want = hopper.plan(p, cpu, int(lengths.max()), 2)
    assert (got.programs, got.host, got.merge, got.cut_blocks) == (want.programs, want.host, want.merge,
                                                                   want.cut_blocks)  # fmt: skip
    assert got.host != hopper.plan(p, cpu, 40000, 2).host  # the steering length would plan otherwise
    for splits in (0, 3):
        bounds = LaunchBounds(max_seqlen=130, steer=40000, num_splits=splits, invariant=False)
        got = triton_attn.plan_launch(p, q.dtype, cpu, bounds)
        want = triton_attn.plan(p, q.dtype, cpu, 40000, 4, num_splits=splits or None)
        assert (got.config, got.num_splits) == (want.config, want.num_splits)
    assert plan.launch.num_splits == triton_attn.plan(p, q.dtype, cpu, int(lengths.max()), 4).num_splits
