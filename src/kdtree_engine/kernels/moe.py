"""Routed and shared experts of the mixture of experts as grouped GEMMs, the kernel twin of
ref.moe.moe_experts_ref: four launches (tile map, gate_up, down, combine) whatever the batch.

No host synchronisation and launch grids that depend only on the shapes (n, k, E, H, I, Is), so a call
can be captured in a CUDA graph and replayed with other routing.

Tiling. The n * k assignments (token, slot), flat index a = token * k + slot, are sorted by expert on
the device: `order[r]` is the assignment at sorted row r, stable (as torch.argsort(ids.flatten(),
stable=True)). Expert e owns the sorted rows bounds[e] .. bounds[e + 1] - 1 and cdiv(count_e, BLOCK_M)
row tiles; a tile never straddles two experts. `_tile_map_kernel` (one program) counts the assignments
per expert (a histogram), writes `bounds` [E + 1], sorts (a counting sort: each assignment's row is
its expert's first row plus the number of earlier assignments of that expert, counted ROWS assignments
per step with a cumulative sum over a [ROWS, E] one-hot block) and writes, per tile, its expert
(`tile_expert`, E for the idle tiles) and first sorted row (`tile_row`, 0 for the idle tiles). The
number of tiles is at most

    sum_e cdiv(count_e, BLOCK_M) <= (n k + min(E, n k) (BLOCK_M - 1)) // BLOCK_M   (= max_tiles)

The shared expert, when given, is one more expert that every token chooses with weight 1: its
S = cdiv(n, BLOCK_M) tiles of consecutive tokens come first in every launch (static, no map needed),
its rows are n k + token in h and y. Every launch has S + max_tiles tile programs; those past the real
tiles do nothing.

`_gate_up_kernel`, grid (tiles, cdiv(max(I, Is), BLOCK_N)): a tile gathers its BLOCK_M rows x[token],
multiplies them by BLOCK_N columns of the expert's gate and up projections (two float32 accumulators,
tl.dot over H in BLOCK_K steps) and stores h = silu(g) * u, computed in float32, in x's dtype.
`_down_kernel`, grid (tiles, cdiv(H, BLOCK_N)): h rows times the expert's down projection, times the
float32 routing weight, stored in float32 into y at the assignment's flat index (the shared rows at
n k + token). `_combine_kernel`, grid (n, cdiv(H, BLOCK)): out[token] = sum over slots 0..k-1 of
y[token k + slot], then + y[n k + token], in float32 in that order, cast once to x's dtype. No atomics:
the same inputs give the same bits on every run.

A token's row does not depend on the other rows of its launch wherever the launch configuration is
the same: a tile's products are per-row dot products over H (or I) in BLOCK_K steps, in order, whatever
the tile's other rows, and the combine sums a token's rows in a fixed order. For 16-bit weights every
launch up to a mean of 32 rows per expert has the same BLOCK_K (BLOCK_N, the columns a program
computes, does not change a product's order) and, on sm_90, the same MMA
instruction (BLOCK_M 16 and 32: mma.sync, HMMA.16816 in the SASS), so one token and a verify of 33
give a token the same bits; 64-row tiles (more rows per expert) halve BLOCK_K and use wgmma (HGMMA).
(The router's kernels, kernels/moe_router.route_hidden, hold the same for the ids and weights.)

Expert parallelism: an id of -1 is an assignment to an expert another rank holds. The histogram and
the counting sort skip it (it takes no sorted row: `order`'s rows from bounds[E] on stay unwritten), no
tile computes it, and the combine adds nothing for its slot.

Each program reads its BLOCK_N slice of the expert's weights once; the programs of one weight slice
follow one another in launch order (the tile index varies fastest), so the row tiles of one expert
share it through the L2 cache. BLOCK_M (16, tl.dot's minimum, in decode) and the blocks are chosen
from the shapes by `launch_config`. Float32 products use IEEE float32 (no TF32); float64 inputs run the
reference (ref.moe.moe_experts_ref, which syncs with the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref.moe import Shared, check_moe_args, max_tiles, moe_experts_ref, shared_expert_ref

__all__ = ["Blocks", "Launch", "launch_config", "max_tiles", "moe_experts", "sort_rows", "tile_map"]

MAP_CHUNK = 1024  # assignments counted per step of the histogram
SORT_CELLS = 4096  # one-hot cells (assignments x experts) per step of the counting sort
DECODE_ROWS = 128  # up to this many assignments (n * k): the decode launch
COMBINE_BLOCK = 1024  # output columns per combine program


@dataclass(frozen=True)
class Blocks:
    """Launch parameters of one GEMM kernel: BLOCK_N output columns and BLOCK_K reduction steps per
    program, warps and software-pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Launch:
    """BLOCK_M, the sorted assignment rows per tile, and the blocks of the two GEMM kernels."""

    block_m: int
    gate_up: Blocks
    down: Blocks


def launch_config(n_assign: int, n_experts: int, itemsize: int) -> Launch:
    """The launch for n_assign = n * k assignments over n_experts experts, weights of itemsize bytes.
    A function of the shapes only, so a captured graph stays valid for any routing.

    Decode (up to DECODE_ROWS assignments): most used experts get a single row or two, so the kernels
    stream the used experts' weights and are memory-bound. BLOCK_M is tl.dot's minimum, 16; every
    reduction step reads 256 bytes of each of the program's 64 weight rows (BLOCK_K 128 for 16-bit
    weights) with four stages in flight.

    Larger batches: BLOCK_M follows the mean rows per expert (16 up to 8, 32 up to 32, else 64) so that
    an expert's weights are read by as few row tiles as possible; at 64-row tiles the products
    dominate and the column blocks are 128 wide. With 16-row tiles (a verify of up to about 8 rows per
    expert) gate_up's column blocks are 128 wide too: half the programs, each streaming twice the
    weight rows (faster at the 2.5B shape's verify, docs/notes/kernels.md); BLOCK_K stays, so a
    row's products keep their order."""
    wide = 256 // itemsize
    if n_assign <= DECODE_ROWS:
        blocks = Blocks(64, wide, 4, 4)
        return Launch(16, blocks, blocks)
    rows = n_assign / n_experts
    if rows <= 8:
        return Launch(16, Blocks(128, wide, 4, 3), Blocks(64, wide, 4, 3))
    if rows <= 32:
        blocks = Blocks(64, wide, 4, 3)
        return Launch(32, blocks, blocks)
    blocks = Blocks(128, wide // 2, 4, 3)
    return Launch(64, blocks, blocks)


def sort_rows(n_experts: int) -> int:
    """Assignments per step of the counting sort: SORT_CELLS one-hot cells over the padded experts,
    8 to 256 rows (a power of two)."""
    return max(8, min(256, SORT_CELLS // triton.next_power_of_2(n_experts)))


@triton.jit
def _counting_sort(ids_ptr, order_ptr, starts, NA, EP: tl.constexpr, ROWS: tl.constexpr):
    """order[starts[e] + #(assignments of e before a)] = a for every assignment a (ids[a] = e), ROWS
    assignments a step: a one-hot [ROWS, EP] block, its cumulative sum down the rows counts the
    earlier assignments of each expert in the step; `cursor` [EP] carries the counts of the steps
    before."""
    ex = tl.arange(0, EP)
    cursor = starts
    for r0 in range(0, NA, ROWS):
        a = r0 + tl.arange(0, ROWS)
        e = tl.load(ids_ptr + a, mask=a < NA, other=-1).to(tl.int32)  # -1: no expert held here
        hot = (e[:, None] == ex[None, :]).to(tl.int32)  # [ROWS, EP]
        before = tl.cumsum(hot, 0) - hot  # same-expert assignments earlier in this step
        row = tl.sum(hot * (before + cursor[None, :]), 1)  # [ROWS] sorted row of each assignment
        tl.store(order_ptr + row, a.to(tl.int64), mask=(a < NA) & (e >= 0))
        cursor += tl.sum(hot, 0)


@triton.jit
def _tile_map_kernel(ids_ptr, order_ptr, bounds_ptr, tile_expert_ptr, tile_row_ptr, NA, E, T,
                     EP: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """One program. counts[e] = #(ids == e) over the NA assignments; bounds[e] = the first sorted row
    of expert e (bounds[E] = the assignments held here, NA without -1 ids); order by the counting sort;
    expert e's tiles are tile_start[e] + j, j < cdiv(counts[e], BLOCK_M), with first sorted row
    bounds[e] + j BLOCK_M; tiles from the total to T get expert E (idle) and row 0."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    ex = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for c0 in range(0, NA, CHUNK):
        a = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < NA, other=0).to(tl.int32)
        counts += tl.histogram(e, EP, mask=(a < NA) & (e >= 0))
    ends = tl.cumsum(counts, 0)
    tl.store(bounds_ptr + ex + 1, ends, mask=ex < E)
    tl.store(bounds_ptr + ex, 0, mask=ex == 0)
    _counting_sort(ids_ptr, order_ptr, ends - counts, NA, EP, ROWS)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_start = tl.cumsum(tiles, 0) - tiles
    for j in range(0, tl.max(tiles, 0)):  # the largest expert's tile count: one step in decode
        mine = (j < tiles) & (ex < E)
        tl.store(tile_expert_ptr + tile_start + j, ex, mask=mine)
        tl.store(tile_row_ptr + tile_start + j, ends - counts + j * BLOCK_M, mask=mine)
    total = tl.sum(tiles, 0)
    for t0 in range(0, T, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        idle = (t >= total) & (t < T)
        tl.store(tile_expert_ptr + t, tl.full([CHUNK], 0, tl.int32) + E, mask=idle)
        tl.store(tile_row_ptr + t, tl.full([CHUNK], 0, tl.int32), mask=idle)


@triton.jit
def _tile(t, S, order_ptr, tile_expert_ptr, tile_row_ptr, bounds_ptr, N, NA, E, TOPK,
          BLOCK_M: tl.constexpr):  # fmt: skip
    """Tile t -> (its expert: E for the shared expert (tiles t < S), -1 for an idle tile; valid
    [BLOCK_M]: the rows that are the expert's; the rows' token (x row), h row and y row, int64).
    Routed tile: h rows are the sorted rows, y rows the assignments a (token a // k); shared tile:
    tokens t BLOCK_M + i, h and y rows NA + token."""
    i = tl.arange(0, BLOCK_M)
    if t < S:
        e = t * 0 + E  # a tensor in both branches, even where Triton makes E == 1 a constant
        token = (t * BLOCK_M + i).to(tl.int64)
        valid = token < N
        h_row = NA + token
        y_row = h_row
    else:
        e = tl.load(tile_expert_ptr + t - S)
        h_row = (tl.load(tile_row_ptr + t - S) + i).to(tl.int64)
        valid = (h_row < tl.load(bounds_ptr + e + 1, mask=e < E, other=0)) & (e < E)
        y_row = tl.load(order_ptr + h_row, mask=valid, other=0)
        token = y_row // TOPK
        e = tl.where(e < E, e, -1)
    return e, valid, token, h_row, y_row


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ws_gate_ptr, ws_up_ptr, h_ptr, order_ptr, tile_expert_ptr, tile_row_ptr,
                    bounds_ptr, N, NA, H, I, IS, IH, TOPK, E, S, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr = False):  # fmt: skip
    """Tile t, columns c0 .. c0 + BLOCK_N of the expert's I (Is for the shared one): h[rows, cols] =
    silu(x W_gate^T) * (x W_up^T), the products accumulated in float32 over H, h stored in x's dtype
    at the tile's valid h rows (row stride IH)."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    t = tl.program_id(0)
    e, valid, token, h_row, _ = _tile(t, S, order_ptr, tile_expert_ptr, tile_row_ptr, bounds_ptr, N, NA, E,
                                      TOPK, BLOCK_M)  # fmt: skip
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if e == E:  # the shared expert: gate [Is, H], up [Is, H]
        inter = IS
        w_gate = ws_gate_ptr + cols[None, :] * H  # [1, BLOCK_N] rows of W_gate
        w_up = ws_up_ptr + cols[None, :] * H
    else:
        inter = I
        w_gate = w_ptr + tl.maximum(e, 0).to(tl.int64) * (2 * I) * H + cols[None, :] * H
        w_up = w_gate + I * H
    if (e >= 0) & (tl.program_id(1) * BLOCK_N < inter):
        col_ok = cols < inter
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + token[:, None] * H  # [BLOCK_M, 1] token rows of x
        g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + kk
            k_ok = ks < H
            xa = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_up + ks[:, None], mask=w_mask, other=0.0)
            g = tl.dot(xa, wg, g, input_precision=PRECISION)
            u = tl.dot(xa, wu, u, input_precision=PRECISION)
        h = g * tl.sigmoid(g) * u
        h_out = h_ptr + h_row[:, None] * IH + cols[None, :]
        tl.store(h_out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, ws_down_ptr, rw_ptr, y_ptr, order_ptr, tile_expert_ptr, tile_row_ptr,
                 bounds_ptr, N, NA, H, I, IS, IH, TOPK, E, S, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    """Tile t, columns c0 .. c0 + BLOCK_N of H: y[y rows, cols] = weight * (h W_down^T), float32, the
    products accumulated over I (Is) in float32; weight: rw[a] (the routing weights [n k] float32) for
    a routed row, 1 for a shared one."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    t = tl.program_id(0)
    e, valid, _, h_row, y_row = _tile(t, S, order_ptr, tile_expert_ptr, tile_row_ptr, bounds_ptr, N, NA, E,
                                      TOPK, BLOCK_M)  # fmt: skip
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    if e == E:  # the shared expert: down [H, Is]
        inter = IS
        w_rows = ws_down_ptr + cols[None, :] * IS  # [1, BLOCK_N] rows of W_down
    else:
        inter = I
        w_rows = w_ptr + tl.maximum(e, 0).to(tl.int64) * H * I + cols[None, :] * I
    if e >= 0:
        kk = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + h_row[:, None] * IH  # [BLOCK_M, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + kk
            k_ok = ks < inter
            ha = tl.load(h_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(ha, w, acc, input_precision=PRECISION)
        acc = acc * tl.load(rw_ptr + y_row, mask=valid & (e < E), other=1.0)[:, None]
        y_out = y_ptr + y_row[:, None] * H + cols[None, :]
        tl.store(y_out, acc, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, NA, H, TOPK: tl.constexpr, SHARED: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Token row, columns c0 .. c0 + BLOCK of H: out = (sum over slots j = 0..k-1 of y[token k + j],
    the slots of id -1 left out) + y[NA + token] (the shared expert, when SHARED), float32 in that
    order, cast to out's dtype."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        held = tl.load(ids_ptr + token * TOPK + j) >= 0
        acc += tl.load(y_ptr + (token * TOPK + j) * H + cols, mask=ok & held, other=0.0)
    if SHARED:
        acc += tl.load(y_ptr + (NA + token) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def tile_map(
    ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, k] int64 in -1..E-1 -> (order [n k] int64: the assignment at each sorted row, stable by
    expert, rows from bounds[E] on unwritten; bounds [E + 1] int32: expert e's sorted rows are bounds[e]
    .. bounds[e + 1] - 1; tile_expert [T] int32: each tile's expert, E when idle; tile_row [T] int32:
    each tile's first sorted row, 0 when idle), T = max_tiles(n k, E, block_m): equal to
    ref.moe.tile_map_ref. One launch, no host sync."""
    flat = ids.reshape(-1)
    n_assign, dev = flat.numel(), ids.device
    n_tiles = max_tiles(n_assign, n_experts, block_m)
    order = torch.empty(n_assign, dtype=torch.int64, device=dev)
    bounds = torch.empty(n_experts + 1, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    tile_row = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    _tile_map_kernel[(1,)](flat, order, bounds, tile_expert, tile_row, n_assign, n_experts, n_tiles,
                           EP=triton.next_power_of_2(n_experts), CHUNK=MAP_CHUNK, ROWS=sort_rows(n_experts),
                           BLOCK_M=block_m, num_warps=4, **pdl.launch(flat.device))  # fmt: skip
    return order, bounds, tile_expert, tile_row


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Shared | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """x [n, H], weights [n, k] float32 (already scaled), ids [n, k] int64 in -1..E-1, w_gate_up
    [E, 2I, H], w_down [E, H, I], shared None or (w_gate [Is, H], w_up [Is, H], w_down [H, Is]) (all in
    x's dtype: float32, bfloat16 or float16) -> [n, H] in x's dtype: for every token, the sum over its
    k choices of weight * down(silu(gate(x)) * up(x)), plus the shared expert's output (ref.moe), with
    float32 accumulation and one rounding; a choice of -1 (an expert held by another rank) adds nothing.
    Four launches, no host sync; float64 runs the reference. Ids outside -1..E-1 are not allowed (their
    output rows would be left unwritten). invariant: the decode launch (16-row tiles) at every size, so
    that a token's row has the same bits whatever else is in the launch (issue 32)."""
    n, k, n_experts, hidden, inter = check_moe_args(x, weights, ids, w_gate_up, w_down, shared)
    if x.dtype == torch.float64:
        return moe_experts_ref(x, weights, ids, w_gate_up, w_down, shared)
    if n == 0 or k == 0:
        return torch.zeros_like(x) if shared is None else shared_expert_ref(x, shared)
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    ws_gate, ws_up, ws_down = (w.contiguous() for w in shared) if shared is not None else (w_gate_up,) * 3
    inter_s = ws_gate.shape[0] if shared is not None else 0
    n_assign, dev = n * k, x.device
    launch = launch_config(min(n_assign, DECODE_ROWS) if invariant else n_assign, n_experts, x.element_size())
    order, bounds, tile_expert, tile_row = tile_map(ids, n_experts, launch.block_m)
    n_shared = triton.cdiv(n, launch.block_m) if shared is not None else 0  # S: the shared tiles
    n_tiles, width = n_shared + tile_expert.numel(), max(inter, inter_s)
    rows = n_assign + (n if shared is not None else 0)  # h and y rows: the assignments, then the shared
    h = torch.empty((rows, width), dtype=x.dtype, device=dev)
    y = torch.empty((rows, hidden), dtype=torch.float32, device=dev)
    tiling = (order, tile_expert, tile_row, bounds, n, n_assign, hidden, inter, inter_s, width, k, n_experts,
              n_shared)  # fmt: skip
    fixed = dict(BLOCK_M=launch.block_m, PRECISION="ieee")  # float32: no TF32; 16-bit: exact products
    gate_up, down = launch.gate_up, launch.down
    _gate_up_kernel[(n_tiles, triton.cdiv(width, gate_up.block_n))](
        x, w_gate_up, ws_gate, ws_up, h, *tiling, **fixed, BLOCK_N=gate_up.block_n,
        BLOCK_K=gate_up.block_k, num_warps=gate_up.num_warps, num_stages=gate_up.num_stages,
        **pdl.launch(x.device),
    )  # fmt: skip
    _down_kernel[(n_tiles, triton.cdiv(hidden, down.block_n))](
        h, w_down, ws_down, weights.reshape(-1).contiguous(), y, *tiling, **fixed, BLOCK_N=down.block_n,
        BLOCK_K=down.block_k, num_warps=down.num_warps, num_stages=down.num_stages,
        **pdl.launch(h.device),
    )  # fmt: skip
    out = torch.empty_like(x)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    _combine_kernel[(n, triton.cdiv(hidden, block))](
        y, ids.contiguous(), out, n_assign, hidden, TOPK=k, SHARED=shared is not None, BLOCK=block,
        **pdl.launch(y.device),
    )  # fmt: skip
    return out
