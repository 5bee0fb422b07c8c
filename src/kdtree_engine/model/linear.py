"""The model's projections on the kernel path: torch's (cuBLAS) by default, the row-invariant GEMM
(kernels/linear.py) when the forward asks for row invariance (ForwardContext.row_invariant; issue 32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def project(x: torch.Tensor, layer: nn.Linear, invariant: bool) -> torch.Tensor:
    """layer(x): x [..., in] -> [..., out]; through the row-invariant GEMM when `invariant`."""
    return linear(x, layer.weight, layer.bias, invariant)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """F.linear(x, weight, bias), or the row-invariant GEMM when `invariant` (imported lazily: triton
    is optional)."""
    if not invariant:
        return F.linear(x, weight, bias)
    from kdtree_engine.kernels.linear import linear as invariant_linear

    return invariant_linear(x, weight, bias)


def per_head_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, invariant: bool) -> torch.Tensor:
    """out[i] = x[i] weight[i] for each head i: x [h, M, K], weight [h, K, N] (any strides), out
    [h, M, N] (a strided view is written in place): torch.bmm, or the row-invariant GEMM."""
    if not invariant:
        return torch.bmm(x, weight, out=out)
    from kdtree_engine.kernels.linear import batched_linear_into

    return batched_linear_into(x, weight.transpose(1, 2), out)
