"""The model's projections on the kernel path, by the forward's GEMM mode (`Gemm`): torch's (cuBLAS),
our small-M GEMM where it beats cuBLAS (kernels/linear.py, launched with PDL), or the row-invariant GEMM
when the forward asks for row invariance (ForwardContext.row_invariant; issue 32)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Gemm = Literal["torch", "small_m", "invariant"]


def gemm_mode(kernels: bool, invariant: bool, device: torch.device) -> Gemm:
    """The projections of a forward: "invariant" for a row-invariant forward on the kernel path;
    "small_m" on the kernel path where launches use programmatic dependent launch (kernels/_pdl.py: the
    small-M GEMM's gain is mostly its overlap with the kernel before it, which a cuBLAS launch breaks);
    else "torch" (the reference path, autograd included)."""
    if not kernels:
        return "torch"
    if invariant:
        return "invariant"
    from kdtree_engine.kernels import _pdl  # imported lazily: triton is optional

    return "small_m" if _pdl.enabled(device) else "torch"


def _small_m(x: torch.Tensor, rows: int, weight: torch.Tensor) -> bool:
    """Whether the small-M GEMM takes these rows of a 16-bit weight (kernels.linear.small_m_wins)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    from kdtree_engine.kernels.linear import small_m_wins

    return small_m_wins(rows, weight.numel() * weight.element_size())


def project(x: torch.Tensor, layer: nn.Linear, gemm: Gemm) -> torch.Tensor:
    """layer(x): x [..., in] -> [..., out], by the forward's GEMM mode."""
    return linear(x, layer.weight, layer.bias, gemm)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: Gemm) -> torch.Tensor:
    """F.linear(x, weight, bias), or one of our GEMMs by `gemm` (imported lazily: triton is optional).
    The small-M GEMM reads the weight before its PDL wait: `weight` is a parameter."""
    small = gemm == "small_m" and _small_m(x, x.numel() // max(1, x.shape[-1]), weight)
    if gemm != "invariant" and not small:
        return F.linear(x, weight, bias)
    from kdtree_engine.kernels.linear import linear as kernel_linear

    return kernel_linear(x, weight, bias, invariant=not small, weight_first=small)


def per_head_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gemm: Gemm) -> torch.Tensor:
    """out[i] = x[i] weight[i] for each head i: x [h, M, K], weight [h, K, N] (any strides, a parameter),
    out [h, M, N] (a strided view is written in place): torch.bmm, or one of our GEMMs by `gemm`."""
    small = gemm == "small_m" and _small_m(x, x.shape[1], weight)
    if gemm != "invariant" and not small:
        return torch.bmm(x, weight, out=out)
    from kdtree_engine.kernels.linear import batched_linear_into

    return batched_linear_into(x, weight.transpose(1, 2), out, invariant=not small, weight_first=small)
