"""The DFlash drafter's per-head q/k RMSNorm + rotary embedding (+ context-cache write) in one launch:
the kernel twins of ref/drafter_qkv.py (same signatures and contract).

block_qkv: one program per block row normalizes and ropes its h query and g key heads in place in the
fused projection and returns views (q, k, v) of it. context_kv_write: one program per (context row,
layer) normalizes and ropes the row's g key heads of that layer and writes them, with the g value
heads, at the row's cache slot. Positions (start or seqlens + row), slots and cos / sin (from the
float32 inverse frequencies) are computed in the kernel: no host read, no extra launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit
def _cos_sin(pos, inv_ptr, j, j_ok, like_ptr):
    """[1, HALF_P] cos and sin of pos * inv_freq, rounded to like_ptr's dtype (as the reference's
    tables)."""
    dtype = like_ptr.dtype.element_ty
    angle = pos.to(tl.float32) * tl.load(inv_ptr + j, mask=j_ok, other=0.0)
    return tl.cos(angle).to(dtype).to(tl.float32), tl.sin(angle).to(dtype).to(tl.float32)


@triton.jit
def _norm_rope(src, dst, heads, stride_h, w_ptr, cos, sin, eps, j, j_ok, HALF: tl.constexpr,
               HEADS_P: tl.constexpr):  # fmt: skip
    """Heads 0 .. heads-1 of one row (head stride stride_h, halves at 0 and HALF): RMSNorm with weight
    w (model.mla.RMSNorm's roundings), rope, stored at dst (same layout) in dst's dtype."""
    dtype = dst.dtype.element_ty
    hh = tl.arange(0, HEADS_P)[:, None]
    mask = (hh < heads) & j_ok
    off = hh * stride_h + j
    x1 = tl.load(src + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + off + HALF, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    y1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(dst + off, (y1 * cos - y2 * sin).to(dtype), mask=mask)
    tl.store(dst + off + HALF, (y2 * cos + y1 * sin).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["T", "stride_b", "stride_t"])
def _block_kernel(qkv_ptr, qw_ptr, kw_ptr, start_ptr, inv_ptr, T, stride_b, stride_t, stride_h, eps,
                  H: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                  H_P: tl.constexpr, G_P: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """qkv [B, T, H + 2G, 2 * HALF]; program = block row (b, t)."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    pid = tl.program_id(0)
    b, t = pid // T, pid % T
    j = tl.arange(0, HALF_P)[None, :]
    j_ok = j < HALF
    cos, sin = _cos_sin(tl.load(start_ptr + b) + t, inv_ptr, j, j_ok, qkv_ptr)
    row = qkv_ptr + b.to(tl.int64) * stride_b + t * stride_t
    _norm_rope(row, row, H, stride_h, qw_ptr, cos, sin, eps, j, j_ok, HALF, H_P)
    k = row + H * stride_h
    _norm_rope(k, k, G, stride_h, kw_ptr, cos, sin, eps, j, j_ok, HALF, G_P)


@triton.jit(do_not_specialize=["C", "stride_b", "stride_c", "stride_kb", "max_slot"])
def _context_kernel(qkv_ptr, kw_ptr, seq_ptr, inv_ptr, ck_ptr, cv_ptr, C, stride_b, stride_c, stride_l,
                    stride_h, stride_wl, stride_kl, stride_kb, stride_ks, stride_kh, max_slot, eps,
                    H: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                    G_P: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """qkv [B, C, n, H + 2G, 2 * HALF]; caches [n, B, S, G, 2 * HALF] (same strides); program =
    (context row (b, c), layer)."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    pid, layer = tl.program_id(0), tl.program_id(1)
    b, c = pid // C, pid % C
    j = tl.arange(0, HALF_P)[None, :]
    j_ok = j < HALF
    pos = tl.load(seq_ptr + b) + c
    cos, sin = _cos_sin(pos, inv_ptr, j, j_ok, ck_ptr)
    src = qkv_ptr + b.to(tl.int64) * stride_b + c * stride_c + layer * stride_l + H * stride_h
    slot = tl.minimum(pos, max_slot)
    dst = layer.to(tl.int64) * stride_kl + b.to(tl.int64) * stride_kb + slot * stride_ks
    _norm_rope(src, ck_ptr + dst, G, stride_h, kw_ptr + layer * stride_wl, cos, sin, eps, j, j_ok, HALF,
               G_P)  # fmt: skip
    hh = tl.arange(0, G_P)[:, None]
    d = tl.arange(0, 2 * HALF_P)[None, :]
    mask = (hh < G) & (d < 2 * HALF)
    v = tl.load(src + G * stride_h + hh * stride_h + d, mask=mask)
    tl.store(cv_ptr + dst + hh * stride_kh + d, v.to(cv_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def block_qkv(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    start: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, h + 2g, d] (last two dims contiguous), overwritten: its q and k heads become normed
    and roped. q_weight / k_weight [d] of qkv's dtype; start [B] int64; inv_freq [d / 2] float32.
    Returns views of qkv: q [B, T, h, d], k [B, T, g, d], v [B, T, g, d]. One launch."""
    b, t, nh, d = qkv.shape
    g = (nh - heads) // 2
    if b * t:
        _block_kernel[(b * t,)](
            qkv, q_weight, k_weight, start, inv_freq, t, qkv.stride(0), qkv.stride(1), qkv.stride(2), eps,
            H=heads, G=g, HALF=d // 2, HALF_P=_pow2(d // 2), H_P=_pow2(heads), G_P=_pow2(g),
            **pdl.launch(qkv.device),
        )  # fmt: skip
    return qkv[:, :, :heads], qkv[:, :, heads : heads + g], qkv[:, :, heads + g :]


def context_kv_write(
    qkv: torch.Tensor,
    k_weight: torch.Tensor,
    seqlens: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    heads: int,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
) -> None:
    """qkv [B, C, n, h + 2g, d] (last two dims contiguous); k_weight [n, d] (rows contiguous);
    seqlens [B] int64; cache_k / cache_v [n, B, S, g, d] of one layout (last two dims contiguous).
    Writes context row c of request b, for every layer, at slot min(seqlens[b] + c, S - 1). One launch."""
    b, c, n, nh, d = qkv.shape
    g = (nh - heads) // 2
    if cache_v.stride() != cache_k.stride():
        raise ValueError("cache_v: expected the strides of cache_k")
    if b * c * n:
        _context_kernel[(b * c, n)](
            qkv, k_weight, seqlens, inv_freq, cache_k, cache_v, c, qkv.stride(0), qkv.stride(1),
            qkv.stride(2), qkv.stride(3), k_weight.stride(0), cache_k.stride(0), cache_k.stride(1),
            cache_k.stride(2), cache_k.stride(3), cache_k.shape[2] - 1, eps,
            H=heads, G=g, HALF=d // 2, HALF_P=_pow2(d // 2), G_P=_pow2(g),
            **pdl.launch(qkv.device),
        )  # fmt: skip
