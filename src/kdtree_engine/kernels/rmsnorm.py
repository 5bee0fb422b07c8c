"""RMSNorm in one launch, the kernel twin of model.mla.RMSNorm: per row, the float32 mean of squares,
x * rsqrt(mean + eps) rounded to x's dtype, then times the weight (rounded to x's dtype). The sum of
squares is reduced in a different order than torch's, so results may differ from the reference in the
last bit of the float32 statistic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dtype = out_ptr.dtype.element_ty
    y = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * y).to(dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (float32, bf16 or fp16, last dim contiguous), weight [D] of x's dtype -> [..., D]."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        warps = 4 if block <= 2048 else 8
        _rmsnorm_kernel[(rows.shape[0],)](
            rows, weight, out, d, rows.stride(0), out.stride(0), eps, BLOCK=block, num_warps=warps
        )
    return out.view(x.shape)
