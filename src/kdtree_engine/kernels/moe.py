"""Routed experts of the mixture of experts as grouped GEMMs, the kernel twin of ref.moe.moe_experts_ref.

No host synchronisation and launch grids that depend only on the shapes (n, k, E, H, I), so a call can
be captured in a CUDA graph and replayed with other routing.

Tiling. The n * k assignments (token, slot), flat index a = token * k + slot, are sorted by expert on
the device (a stable argsort of ids.flatten(): `order[r]` is the assignment at sorted row r). Expert
e owns the sorted rows bounds[e] .. bounds[e + 1] - 1 and cdiv(count_e, BLOCK_M) row tiles; a tile
never straddles two experts. `_tile_map_kernel` (one program) counts the assignments per expert,
writes `bounds` [E + 1] and, per tile, its expert (`tile_expert`, E for the idle tiles) and first
sorted row (`tile_row`). The number of tiles is at most

    sum_e cdiv(count_e, BLOCK_M) <= (n k + min(E, n k) (BLOCK_M - 1)) // BLOCK_M   (= max_tiles)

and every launch has max_tiles tile programs; those past the real tiles do nothing.

`_gate_up_kernel`, grid (max_tiles, cdiv(I, BLOCK_N)): a tile gathers its BLOCK_M rows x[token],
multiplies them by BLOCK_N columns of the expert's gate and up projections (two float32 accumulators,
tl.dot over H in BLOCK_K steps) and stores h = silu(g) * u, computed in float32, in x's dtype, into
h [n k, I] at the sorted rows. `_down_kernel`, grid (max_tiles, cdiv(H, BLOCK_N)): h rows times the
expert's down projection, times the float32 routing weight, stored in float32 into y [n k, H] at the
assignment's own flat index. The combine out = y.view(n, k, H).sum(1) runs without atomics, so the
same inputs give the same bits on every run.

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
from kdtree_engine.ref.moe import check_moe_args, moe_experts_ref

MAP_CHUNK = 1024  # assignments counted per step of the tile map
DECODE_ROWS = 128  # up to this many assignments (n * k): the decode launch


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
    dominate and the column blocks are 128 wide."""
    wide = 256 // itemsize
    if n_assign <= DECODE_ROWS:
        blocks = Blocks(64, wide, 4, 4)
        return Launch(16, blocks, blocks)
    rows = n_assign / n_experts
    if rows <= 32:
        blocks = Blocks(64, wide, 4, 3)
        return Launch(16 if rows <= 8 else 32, blocks, blocks)
    blocks = Blocks(128, wide // 2, 4, 3)
    return Launch(64, blocks, blocks)


def max_tiles(n_assign: int, n_experts: int, block_m: int) -> int:
    """Static bound on the row tiles: sum_e cdiv(count_e, block_m) over at most min(E, n_assign) used
    experts whose counts add up to n_assign."""
    return (n_assign + min(n_experts, n_assign) * (block_m - 1)) // block_m


@triton.jit
def _tile_map_kernel(ids_ptr, bounds_ptr, tile_expert_ptr, tile_row_ptr, NA, E, T, EP: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """One program. counts[e] = #(ids == e) over the NA assignments; bounds[e] = the first sorted row
    of expert e (bounds[E] = NA); expert e's tiles are tile_start[e] + j, j < cdiv(counts[e], BLOCK_M),
    with first sorted row bounds[e] + j BLOCK_M; tiles from the total to T get expert E (idle)."""
    ex = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for c0 in range(0, NA, CHUNK):
        a = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + a, mask=a < NA, other=0).to(tl.int32)
        counts += tl.histogram(e, EP, mask=a < NA)
    ends = tl.cumsum(counts, 0)
    tl.store(bounds_ptr + ex + 1, ends, mask=ex < E)
    tl.store(bounds_ptr + ex, 0, mask=ex == 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_start = tl.cumsum(tiles, 0) - tiles
    for j in range(0, tl.max(tiles, 0)):  # the largest expert's tile count: one step in decode
        mine = (j < tiles) & (ex < E)
        tl.store(tile_expert_ptr + tile_start + j, ex, mask=mine)
        tl.store(tile_row_ptr + tile_start + j, ends - counts + j * BLOCK_M, mask=mine)
    total = tl.sum(tiles, 0)
    for t0 in range(0, T, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        tl.store(tile_expert_ptr + t, tl.full([CHUNK], 0, tl.int32) + E, mask=(t >= total) & (t < T))


@triton.jit
def _tile(t, order_ptr, tile_row_ptr, bounds_ptr, e, BLOCK_M: tl.constexpr):
    """Sorted rows [BLOCK_M] of tile t of expert e, which of them are the expert's (valid), and their
    assignments' flat indices (token * k + slot; 0 where not valid)."""
    rows = tl.load(tile_row_ptr + t) + tl.arange(0, BLOCK_M)
    valid = rows < tl.load(bounds_ptr + e + 1)
    assign = tl.load(order_ptr + rows, mask=valid, other=0)
    return rows.to(tl.int64), valid, assign


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, bounds_ptr, H, I, TOPK,
                    E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    """Tile t, columns c0 .. c0 + BLOCK_N of I: h[rows, cols] = silu(x W_gate^T) * (x W_up^T), the
    products accumulated in float32 over H, h stored in x's dtype at the tile's valid sorted rows."""
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e < E:
        rows, valid, assign = _tile(t, order_ptr, tile_row_ptr, bounds_ptr, e, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + (assign // TOPK)[:, None] * H  # [BLOCK_M, 1] token rows of x
        w_gate = w_ptr + e.to(tl.int64) * (2 * I) * H + cols[None, :] * H  # [1, BLOCK_N] rows of W_gate
        w_up = w_gate + I * H
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
        h_out = h_ptr + rows[:, None] * I + cols[None, :]
        tl.store(h_out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, rw_ptr, y_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, bounds_ptr, H, I, E,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):  # fmt: skip
    """Tile t, columns c0 .. c0 + BLOCK_N of H: y[assign, cols] = weight[assign] * (h W_down^T), float32,
    at the valid rows' flat assignment indices (rw: the routing weights [n k] float32)."""
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e < E:
        rows, valid, assign = _tile(t, order_ptr, tile_row_ptr, bounds_ptr, e, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        kk = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + rows[:, None] * I  # [BLOCK_M, 1]
        w_rows = w_ptr + e.to(tl.int64) * H * I + cols[None, :] * I  # [1, BLOCK_N] rows of W_down
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + kk
            k_ok = ks < I
            ha = tl.load(h_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(ha, w, acc, input_precision=PRECISION)
        acc = acc * tl.load(rw_ptr + assign, mask=valid, other=0.0)[:, None]
        y_out = y_ptr + assign.to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(y_out, acc, mask=valid[:, None] & col_ok[None, :])


def tile_map(
    ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, k] int64 -> (order [n k] int64: the assignment at each sorted row, stable by expert;
    bounds [E + 1] int32: expert e's sorted rows are bounds[e] .. bounds[e + 1] - 1; tile_expert [T]
    int32: each tile's expert, E when idle; tile_row [T] int32: each tile's first sorted row, set for
    the real tiles only), T = max_tiles(n k, E, block_m). Device ops only."""
    flat = ids.reshape(-1)
    n_assign, dev = flat.numel(), ids.device
    n_tiles = max_tiles(n_assign, n_experts, block_m)
    order = torch.argsort(flat, stable=True)
    bounds = torch.empty(n_experts + 1, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    tile_row = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    _tile_map_kernel[(1,)](flat, bounds, tile_expert, tile_row, n_assign, n_experts, n_tiles,
                           EP=triton.next_power_of_2(n_experts), CHUNK=MAP_CHUNK, BLOCK_M=block_m,
                           num_warps=4)  # fmt: skip
    return order, bounds, tile_expert, tile_row


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """x [n, H], weights [n, k] float32 (already scaled), ids [n, k] int64 in 0..E-1, w_gate_up
    [E, 2I, H], w_down [E, H, I] (x's dtype: float32, bfloat16 or float16) -> [n, H] in x's dtype: for
    every token, the sum over its k choices of weight * down(silu(gate(x)) * up(x)) (ref.moe), with
    float32 accumulation. No host sync; float64 runs the reference. Ids outside 0..E-1 are not
    allowed (their output rows would be left unwritten)."""
    n, k, n_experts, hidden, inter = check_moe_args(x, weights, ids, w_gate_up, w_down)
    if x.dtype == torch.float64:
        return moe_experts_ref(x, weights, ids, w_gate_up, w_down)
    if n == 0 or k == 0:
        return torch.zeros_like(x)
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    n_assign = n * k
    launch = launch_config(n_assign, n_experts, x.element_size())
    order, bounds, tile_expert, tile_row = tile_map(ids, n_experts, launch.block_m)
    n_tiles = tile_expert.numel()
    h = torch.empty((n_assign, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((n_assign, hidden), dtype=torch.float32, device=x.device)
    tiling = (order, tile_expert, tile_row, bounds)
    fixed = dict(BLOCK_M=launch.block_m, PRECISION="ieee")  # float32: no TF32; 16-bit: exact products
    gate_up, down = launch.gate_up, launch.down
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, gate_up.block_n))](
        x, w_gate_up, h, *tiling, hidden, inter, k, n_experts, **fixed, BLOCK_N=gate_up.block_n,
        BLOCK_K=gate_up.block_k, num_warps=gate_up.num_warps, num_stages=gate_up.num_stages,
    )  # fmt: skip
    _down_kernel[(n_tiles, triton.cdiv(hidden, down.block_n))](
        h, w_down, weights.reshape(-1).contiguous(), y, *tiling, hidden, inter, n_experts, **fixed,
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, num_warps=down.num_warps, num_stages=down.num_stages,
    )  # fmt: skip
    return y.view(n, k, hidden).sum(1).to(x.dtype)
