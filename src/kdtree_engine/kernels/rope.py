"""Rotary embedding in one launch, the kernel twin of model.rope.apply_rope, bit for bit: each product,
difference and sum is rounded to the tensor's dtype in the order torch's elementwise ops round them.
Source and destination may be strided views (a query's rope dims, written straight into the absorbed
query buffer): no copy either side. Each token's arithmetic depends only on that token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release


@triton.jit(do_not_specialize=["T", "sx_b", "sx_t", "sx_h", "so_b", "so_t", "so_h"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, T, sx_b, sx_t, sx_h, so_b, so_t, so_h,
                 HALF: tl.constexpr, HEADS: tl.constexpr, INTERLEAVE: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    """Program = one token (b, i) (all its heads): x / out [B, T, heads, 2 * HALF] (strides given, the
    last dim contiguous), cos/sin [B * T, HALF] contiguous."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    tok = tl.program_id(0)
    b, i = tok // T, tok % T
    h = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = h < heads
    base = x_ptr + b * sx_b + i * sx_t + h * sx_h
    if INTERLEAVE:
        x1 = tl.load(base + 2 * j, mask=mask, other=0.0)
        x2 = tl.load(base + 2 * j + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(base + j, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + j, mask=mask, other=0.0)
    dtype = x1.dtype
    c = tl.load(cos_ptr + tok * HALF + j).to(tl.float32)
    s = tl.load(sin_ptr + tok * HALF + j).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    out = out_ptr + b * so_b + i * so_t + h * so_h
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out + j, first.to(dtype).to(out_dtype), mask=mask)
    tl.store(out + HALF + j, second.to(dtype).to(out_dtype), mask=mask)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, head) strides of [b, t, (h,) d]; a view whose last dim is not contiguous is
    copied by the caller."""
    return x.stride(0), x.stride(1), x.stride(2) if x.dim() == 4 else 0


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [b, t, (h,) d] with cos/sin [b, t, d // 2] of x's dtype -> roped x, rounded to x's dtype and
    then to out's. out: where to write (x's shape, any strides with the last dim contiguous, e.g. the
    last d columns of a wider buffer); default a new contiguous tensor. Returns out."""
    b, t, d = x.shape[0], x.shape[1], x.shape[-1]
    heads = x.shape[2] if x.dim() == 4 else 1
    src = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if b * t:
        _rope_kernel[(b * t,)](
            src, cos.contiguous(), sin.contiguous(), out, heads, t, *_strides(src), *_strides(out),
            HALF=d // 2, HEADS=triton.next_power_of_2(heads), INTERLEAVE=interleave,
            enable_fp_fusion=False,  # torch rounds each product before the sum: no FMA contraction
            **pdl.launch(src.device),
        )  # fmt: skip
    return out
