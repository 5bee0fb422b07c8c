"""Per-node target sampling on the GPU (twin of ref.sampling.sample_tokens): one program per tree
node streams its vocab row once, keeping the running Gumbel-max winner. The division is the correctly
rounded `div_rn` and the add follows a division, so no fused multiply-add can change a rounding.

Seeded noise (ref.sampling.Seeded) is computed in the kernel from (seed, offset, b, n, v) with the same
integer steps as the reference (uint32 hash, int64 Q30 logarithms, tables shared as int64 tensors),
never materialized. A tile whose best possible score, max(x / T) + GUMBEL_MAX, cannot beat the running
best (ties go to the earlier, smaller id) skips the noise: rounding is monotone, so the skip is exact."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref import sampling as ref

_Q = tl.constexpr(ref.Q)
_LN2_Q = tl.constexpr(ref.LN2_Q)
_THIRD_Q = tl.constexpr(ref.THIRD_Q)
_FIVE_24THS_Q = tl.constexpr(ref.FIVE_24THS_Q)
_TABLE_SHIFT = tl.constexpr(ref.Q - ref.TABLE_BITS)
_TABLE_MASK = tl.constexpr(2**ref.TABLE_BITS - 1)
_ONE_Q = tl.constexpr(1 << ref.Q)
_G_SHIFT = tl.constexpr(ref.G_SHIFT)
_GRID_HALF = tl.constexpr(ref.GRID_HALF)
_GUMBEL_MAX = tl.constexpr(ref.GUMBEL_MAX)


@triton.jit
def _keep_best(score, offs, V, best, best_id):
    """Running argmax over vocab tiles: this tile's best score (smallest id among ties) replaces
    (best, best_id) only if strictly better, so an earlier tile keeps ties."""
    top = tl.max(score, axis=0)
    top_id = tl.min(tl.where(score == top, offs, V), axis=0)
    better = top > best
    return tl.where(better, top, best), tl.where(better, top_id, best_id)


@triton.jit
def _sample_kernel(
    x_ptr,
    g_ptr,
    cut_ptr,
    out_ptr,
    V,
    temperature,
    BLOCK: tl.constexpr,
    NT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cut = tl.load(cut_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], tl.int64)
    for t in range(NT):
        offs = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = offs < V
        x = tl.load(x_ptr + row * V + offs, mask=inside, other=float("-inf")).to(tl.float32)
        g = tl.load(g_ptr + row * V + offs, mask=inside, other=0.0)
        score = tl.where(inside & (x >= cut), tl.math.div_rn(x, temperature) + g, float("-inf"))
        best, best_id = _keep_best(score, offs, V, best, best_id)
    tl.store(out_ptr + row, best_id)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (ref.sampling.mix32); products wrap mod 2^32."""
    x ^= x >> 16
    x = x * 0x7FEB352D
    x ^= x >> 15
    x = x * 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _log_parts(x, recip_ptr, log_ptr):
    """x int64 in [1, 2^40) -> (k, f): ln x ~ k ln 2 + f / 2^30 (ref.sampling._log_parts)."""
    k = (x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023
    m = tl.where(k <= _Q, x << tl.maximum(_Q - k, 0), x >> tl.maximum(k - _Q, 0))
    i = (m >> _TABLE_SHIFT) & _TABLE_MASK
    r = ((m * tl.load(recip_ptr + i)) >> 31) - _ONE_Q
    r2 = (r * r) >> _Q
    r3 = (r2 * r) >> _Q
    f = tl.load(log_ptr + i) + r - (r2 >> 1) + ((r3 * _THIRD_Q) >> _Q)
    return k, f


@triton.jit
def _seeded_gumbel(h, recip_ptr, log_ptr):
    """h int64 in [0, 2^32) -> g float32 (ref.sampling.gumbel_fixed then gumbel_from_fixed)."""
    a = 2 * h + 1
    d = (1 << 33) - a
    tail = d < (1 << 25)
    k1, f1 = _log_parts(tl.where(tail, d, a), recip_ptr, log_ptr)
    head = (33 - k1) * _LN2_Q - f1
    k2, f2 = _log_parts(tl.maximum(head, 1), recip_ptr, log_ptr)
    body = (_Q - k2) * _LN2_Q - f2
    w = d >> 3
    w2 = (w * w) >> _Q
    w3 = (w2 * w) >> _Q
    tail_g = head - ((w >> 1) + ((w2 * _FIVE_24THS_Q) >> _Q) + (w3 >> 3))
    big_g = tl.where(tail, tail_g, body) >> _G_SHIFT
    return (2 * big_g + 1).to(tl.float32) * _GRID_HALF


@triton.jit(do_not_specialize=["p0", "p1"])
def _sample_seeded_kernel(
    x_ptr,
    cut_ptr,
    out_ptr,
    recip_ptr,
    log_ptr,
    V,
    N,
    temperature,
    p0,
    p1,
    keys_ptr,
    BLOCK: tl.constexpr,
    NT: tl.constexpr,
    KEYS_IN_MEMORY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    if KEYS_IN_MEMORY:  # the stream keys of this draw, written by the device (a replayed graph)
        p0 = tl.load(keys_ptr)
        p1 = tl.load(keys_ptr + 1)
    b = (row // N).to(tl.uint32)
    n = (row % N).to(tl.uint32)
    r0 = _mix32(_mix32(p0.to(tl.uint32, bitcast=True) ^ b) ^ n)
    r1 = _mix32(_mix32(p1.to(tl.uint32, bitcast=True) ^ b) ^ n)
    cut = tl.load(cut_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], tl.int64)
    for t in range(NT):
        offs = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = offs < V
        x = tl.load(x_ptr + row * V + offs, mask=inside, other=float("-inf")).to(tl.float32)
        q = tl.where(inside & (x >= cut), tl.math.div_rn(x, temperature), float("-inf"))
        if tl.max(q, axis=0) + _GUMBEL_MAX > best:  # else no score here can beat best (ties: earlier)
            h = _mix32(_mix32(offs.to(tl.uint32) ^ r0) ^ r1).to(tl.int64)
            score = q + _seeded_gumbel(h, recip_ptr, log_ptr)
            best, best_id = _keep_best(score, offs, V, best, best_id)
    tl.store(out_ptr + row, best_id)


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    recip = torch.tensor(ref.RECIP_TABLE, dtype=torch.int64, device=device)
    return recip, torch.tensor(ref.LOG_TABLE, dtype=torch.int64, device=device)


def _as_int32(key: int) -> int:
    """A 32-bit key passed as a signed int32 kernel argument (bit-cast back in the kernel)."""
    return key - (1 << 32) if key >= 1 << 31 else key


def sample_tokens(
    logits: torch.Tensor, noise, cutoffs: torch.Tensor, temperature: float, *, block: int | None = None
) -> torch.Tensor:
    """logits [B, N, V] float, noise [B, N, V] float32, ref.sampling.Seeded, or the Seeded stream keys
    [2] int32 on the device (ref.sampling.stream_key_table's row of the draw), cutoffs [B, N] float32
    (validated, one device), temperature a float32 value > 0 -> tokens [B, N] int64, equal to
    ref.sampling.sample_tokens. block: vocab tile (a power of two; default min(2048 or 4096, V))."""
    b, n, vocab = logits.shape
    out = torch.zeros((b, n), dtype=torch.int64, device=logits.device)
    if b * n == 0 or vocab == 0:
        return out
    seeded = isinstance(noise, ref.Seeded) or noise.dtype == torch.int32
    block = block or min(2048 if seeded else 4096, triton.next_power_of_2(vocab))
    meta = dict(BLOCK=block, NT=triton.cdiv(vocab, block), num_warps=8)
    if not seeded:
        _sample_kernel[(b * n,)](
            logits.contiguous(),
            noise.contiguous(),
            cutoffs.contiguous(),
            out,
            vocab,
            temperature,
            **meta,
            **pdl.launch(logits.device),
        )
        return out
    if isinstance(noise, torch.Tensor):  # stream keys [2] int32 on the device
        p0, p1, keys = 0, 0, noise
    else:
        p0, p1 = (_as_int32(k) for k in ref.stream_keys(noise.seed, noise.offset))
        keys = out  # unread
    recip, log = _tables(logits.device)
    _sample_seeded_kernel[(b * n,)](
        logits.contiguous(),
        cutoffs.contiguous(),
        out,
        recip,
        log,
        vocab,
        n,
        temperature,
        p0,
        p1,
        keys,
        KEYS_IN_MEMORY=isinstance(noise, torch.Tensor),
        **meta,
        **pdl.launch(logits.device),
    )
    return out
