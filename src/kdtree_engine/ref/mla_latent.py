"""The latent cache row write of one MLA layer: the specification of kernels/mla_latent.py (same
signature), plain torch with the model's roundings.

A row of the kv_a projection [r + d_r] splits into c_kv [r] and k_pe [d_r]. c_kv is RMS-normed as
model.mla.RMSNorm does it (float32 statistic, the normalized value rounded to the dtype, times the
weight, rounded); k_pe is roped as model.rope.apply_rope does it (each product, difference and sum
rounded to the dtype; `interleave` as HF's rope_interleave). The row [c_kv, k_pe], cast to the cache's
dtype, goes to slot start[b] + i of request b.

Dimension names: b batch, t new tokens, r kv_lora_rank, d_r qk_rope_head_dim, S cache slots.
"""

from __future__ import annotations

import torch


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
    """kv_a [b, t, r + d_r] (float32, bf16, fp16 or float64); weight [r] of kv_a's dtype; cos / sin
    [b, t, d_r / 2] of kv_a's dtype; kv_layer [b, S, r + d_r] written in place at rows start[b] + i,
    i < t (start [b] int64, start[b] + t <= S)."""
    d_r = cos.shape[-1] * 2
    c_kv, k_pe = kv_a.split([kv_a.shape[-1] - d_r, d_r], dim=-1)
    xf = c_kv.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    c_kv = weight * xf.to(kv_a.dtype)
    if interleave:
        x1, x2 = k_pe[..., 0::2], k_pe[..., 1::2]
    else:
        x1, x2 = k_pe.chunk(2, dim=-1)
    k_pe = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    t = kv_a.shape[1]
    rows = torch.arange(kv_a.shape[0], device=kv_a.device)[:, None]  # [b, 1]
    slots = start[:, None] + torch.arange(t, device=kv_a.device)  # [b, t]
    kv_layer[rows, slots] = torch.cat([c_kv, k_pe], dim=-1).to(kv_layer.dtype)
