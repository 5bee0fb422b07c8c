"""Reference of kernels/linear.py, the row-invariant projection y = x W^T + b: the values it must have
(float32 accumulation, one rounding to x's dtype). The kernel's own property, that a row's bits do not
depend on the other rows of its launch, is tested on the kernel itself (tests/kernels/test_linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    """Shapes and dtypes (metadata only); returns (N, K)."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected [..., {k}] (K of weight), got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"weight: expected x's dtype ({x.dtype}, one of {DTYPES}), got {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias: expected [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"weight: expected x's device {x.device}, got {weight.device}")
    return n, k


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N] in x's dtype: the products summed in
    float32 (float64 for float64 inputs), the bias added, rounded once."""
    check_linear_args(x, weight, bias)
    wide = torch.promote_types(x.dtype, torch.float32)
    out = F.linear(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide))
    return out.to(x.dtype)
