"""The latent cache row write of one MLA layer in one launch: the kernel twin of ref/mla_latent.py
(same signature and contract). It replaces kv_a_layernorm + rope of k_pe + cat + index_put.

One program per new token (b, i): it RMS-norms c_kv with the roundings of kernels/rmsnorm.py (the same
float32 sum of squares over one block of next_power_of_2(r), so the bits of the RMSNorm kernel), ropes
k_pe with the roundings of kernels/rope.py (bit for bit the torch reference), and stores the row at
slot start[b] + i of kv_layer. Each row's arithmetic depends only on that row: the same bits whatever
b and t are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit(do_not_specialize=["T", "stride_b", "stride_t", "stride_kb", "stride_ks"])
def _latent_kernel(a_ptr, w_ptr, cos_ptr, sin_ptr, kv_ptr, start_ptr, T, stride_b, stride_t, stride_kb,
                   stride_ks, R, eps, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
                   INTERLEAVE: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """kv_a [B, T, R + 2 HALF] (last dim contiguous), cos / sin [B * T, HALF] contiguous, kv [B, S, R + 2
    HALF] (last dim contiguous); program = token (b, i)."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    tok = tl.program_id(0)
    b = tok // T
    i = tok % T
    src = a_ptr + b * stride_b + i * stride_t
    dtype = a_ptr.dtype.element_ty
    out_dtype = kv_ptr.dtype.element_ty
    dst = kv_ptr + b * stride_kb + (tl.load(start_ptr + b) + i) * stride_ks
    offs = tl.arange(0, BLOCK_R)
    mask = offs < R
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / R + eps)
    y = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, (w * y).to(dtype).to(out_dtype), mask=mask)
    j = tl.arange(0, HALF)
    if INTERLEAVE:
        x1 = tl.load(src + R + 2 * j).to(tl.float32)
        x2 = tl.load(src + R + 2 * j + 1).to(tl.float32)
    else:
        x1 = tl.load(src + R + j).to(tl.float32)
        x2 = tl.load(src + R + HALF + j).to(tl.float32)
    c = tl.load(cos_ptr + tok * HALF + j).to(tl.float32)
    s = tl.load(sin_ptr + tok * HALF + j).to(tl.float32)
    first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(dst + R + j, first.to(dtype).to(out_dtype))
    tl.store(dst + R + HALF + j, second.to(dtype).to(out_dtype))


def latent_write(
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    kv_layer: torch.Tensor,
    start: torch.Tensor,
) -> None:
    """kv_a [b, t, r + d_r] (float32, bf16 or fp16, last dim contiguous); weight [r] of kv_a's dtype;
    cos / sin [b, t, d_r / 2] of kv_a's dtype, d_r / 2 a power of two; kv_layer [b, S, r + d_r] (last
    dim contiguous) written in place at rows start[b] + i, i < t (start [b] int64 on kv_a's device,
    start[b] + t <= S: not checked here)."""
    b, t, d = kv_a.shape
    half = cos.shape[-1]
    if b * t == 0:
        return
    block = triton.next_power_of_2(d - 2 * half)  # and the warps: as kernels/rmsnorm.py, for its bits
    _latent_kernel[(b * t,)](
        kv_a, weight, cos.contiguous(), sin.contiguous(), kv_layer, start, t, kv_a.stride(0),
        kv_a.stride(1), kv_layer.stride(0), kv_layer.stride(1), d - 2 * half, eps,
        BLOCK_R=block, HALF=half, INTERLEAVE=interleave, num_warps=4 if block <= 2048 else 8,
        enable_fp_fusion=False,  # the rope rounds each product before the sum, as torch: no FMA contraction
        **pdl.launch(kv_a.device),
    )  # fmt: skip
