"""Rotary embedding in one launch, the kernel twin of model.rope.apply_rope, bit for bit: each product,
difference and sum is rounded to the tensor's dtype in the order torch's elementwise ops round them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, HALF: tl.constexpr, HEADS: tl.constexpr,
                 INTERLEAVE: tl.constexpr):  # fmt: skip
    """Program = one token (all its heads): x [tokens, heads, 2 * HALF], cos/sin [tokens, HALF]."""
    tok = tl.program_id(0)
    h = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = h < heads
    base = x_ptr + tok * heads * 2 * HALF + h * 2 * HALF
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
    out = out_ptr + tok * heads * 2 * HALF + h * 2 * HALF
    tl.store(out + j, first.to(dtype), mask=mask)
    tl.store(out + HALF + j, second.to(dtype), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [b, t, (h,) d] with cos/sin [b, t, d // 2] of x's dtype -> roped x, a new contiguous tensor."""
    b, t, d = x.shape[0], x.shape[1], x.shape[-1]
    heads = x.shape[2] if x.dim() == 4 else 1
    half = d // 2
    src = x.contiguous()
    out = torch.empty_like(src)
    if b * t:
        _rope_kernel[(b * t,)](
            src, cos.contiguous(), sin.contiguous(), out, heads,
            HALF=half, HEADS=triton.next_power_of_2(heads), INTERLEAVE=interleave,
        )  # fmt: skip
    return out
