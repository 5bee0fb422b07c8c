"""Rotary embedding of the qk_rope_head_dim dims, with yarn, numerically as transformers' deepseek_v3.

transformers computes the inverse frequencies, the angles and cos/sin in float32 whatever the model
dtype, then casts cos/sin to the activation dtype; we do the same so that float64 runs match it.
"""

from __future__ import annotations

import math

import torch

from kdtree_engine.impl import resolve_impl
from kdtree_engine.model.config import ModelConfig


def _yarn_correction_range(c: ModelConfig, dim: int) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        ratio = c.rope_original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (dim * math.log(ratio)) / (2 * math.log(c.rope_theta))

    low, high = correction_dim(c.rope_beta_fast), correction_dim(c.rope_beta_slow)
    if c.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_freq(c: ModelConfig) -> torch.Tensor:
    """[qk_rope_head_dim // 2] float32 inverse frequencies (yarn-blended when rope_type == "yarn")."""
    dim = c.qk_rope_head_dim
    pos_freqs = c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if c.rope_type == "default":
        return 1.0 / pos_freqs
    low, high = _yarn_correction_range(c, dim)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequencies
    return (1.0 / (c.rope_factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def cos_sin(c: ModelConfig, freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [b, t] int64 -> (cos, sin) each [b, t, qk_rope_head_dim // 2] in `dtype`."""
    angles = positions[..., None].float() * freqs.to(device=positions.device, dtype=torch.float32)
    scale = c.rope_cos_sin_scale
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, impl: str | None = "ref"
) -> torch.Tensor:
    """x [b, t, (h,) d] with cos/sin [b, t, d // 2] -> roped x, same shape.

    interleave=True (HF `rope_interleave`): pairs (x0, x1), (x2, x3), ... are rotated and the result is
    laid out as [rotated evens, rotated odds]; False: the halves (x[:d/2], x[d/2:]) form the pairs.
    impl: "ref" (torch ops) or a kernel impl (one launch, the same bits; float32 / bf16 / fp16 with
    d // 2 a power of two).
    """
    half = x.shape[-1] // 2
    kernel_ok = x.dtype in (torch.float32, torch.bfloat16, torch.float16) and half & (half - 1) == 0
    if kernel_ok and cos.dtype == x.dtype and resolve_impl(impl, x.device) == "triton":
        from kdtree_engine.kernels import rope as kernels  # imported lazily: triton is optional

        return kernels.apply_rope(x, cos, sin, interleave)
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
