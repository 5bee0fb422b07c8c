"""The DFlash drafter's SwiGLU activation on a fused gate/up projection: the specification of
kernels/drafter_mlp.py (same signature), float32 math, rounded once."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (columns 0 .. I-1 the gate projection, I .. 2I-1 the up projection; float32,
    bf16 or fp16) -> silu(gate) * up [M, I] in gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)
