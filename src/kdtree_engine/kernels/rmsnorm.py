"""RMSNorm in one launch, the kernel twin of model.mla.RMSNorm: per row, the float32 mean of squares,
x * rsqrt(mean + eps) rounded to x's dtype, then times the weight (rounded to x's dtype). The sum of
squares is reduced in a different order than torch's, so results may differ from the reference in the
last bit of the float32 statistic.

add_rmsnorm fuses the residual add before it: s = x + delta rounded to the dtype (as torch's add), then
the same RMSNorm of s; it returns both. One program per row, the whole row in one block: a row's bits
depend only on that row, whatever the number of rows. Compiled without FMA contraction, as the fused
latent-row kernel (kernels/mla_latent.py), whose norm must give these bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, out_ptr, D, stride_x, stride_out, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dtype = out_ptr.dtype.element_ty
    y = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * y).to(dtype), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, D, stride_x, stride_d, eps,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dtype = out_ptr.dtype.element_ty
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
    s = (a + b).to(dtype)
    tl.store(sum_ptr + row * D + offs, s, mask=mask)
    x = s.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (w * y).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def add_rmsnorm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., D] of one dtype (float32, bf16 or fp16), weight [D] of that dtype -> (x + delta,
    rmsnorm(x + delta)), both new contiguous [..., D] tensors."""
    d = x.shape[-1]
    xr, dr = _rows(x), _rows(delta)
    total = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if xr.shape[0]:
        block = triton.next_power_of_2(d)
        _add_rmsnorm_kernel[(xr.shape[0],)](
            xr, dr, weight, total, out, d, xr.stride(0), dr.stride(0), eps, BLOCK=block,
            num_warps=_warps(block), enable_fp_fusion=False,
            **pdl.launch(xr.device),
        )  # fmt: skip
    return total.view(x.shape), out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (float32, bf16 or fp16, last dim contiguous), weight [D] of x's dtype -> [..., D]."""
    d = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        warps = _warps(block)
        _rmsnorm_kernel[(rows.shape[0],)](
            rows, weight, out, d, rows.stride(0), out.stride(0), eps, BLOCK=block, num_warps=warps,
            enable_fp_fusion=False,
            **pdl.launch(rows.device),
        )  # fmt: skip
    return out.view(x.shape)
