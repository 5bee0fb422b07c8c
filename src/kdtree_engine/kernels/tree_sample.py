"""Per-node target sampling on the GPU (twin of ref.sampling.sample_tokens): one program per tree
node streams its vocab row once, keeping the running Gumbel-max winner. The division is the correctly
rounded `div_rn` and the add follows a division, so no fused multiply-add can change a rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(x_ptr, g_ptr, cut_ptr, out_ptr, V, temperature, BLOCK: tl.constexpr, NT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cut = tl.load(cut_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], tl.int64)
    for t in range(NT):
        offs = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = offs < V
        x = tl.load(x_ptr + row * V + offs, mask=inside, other=float("-inf")).to(tl.float32)
        g = tl.load(g_ptr + row * V + offs, mask=inside, other=0.0)
        score = tl.where(inside & (x >= cut), tl.math.div_rn(x, temperature) + g, float("-inf"))
        top = tl.max(score, axis=0)
        top_id = tl.min(tl.where(score == top, offs, V), axis=0)
        better = top > best  # strictly: an earlier tile keeps ties
        best = tl.where(better, top, best)
        best_id = tl.where(better, top_id, best_id)
    tl.store(out_ptr + row, best_id)


def sample_tokens(
    logits: torch.Tensor, noise: torch.Tensor, cutoffs: torch.Tensor, temperature: float
) -> torch.Tensor:
    """logits [B, N, V] float, noise [B, N, V] float32, cutoffs [B, N] float32 (validated, one device),
    temperature a float32 value > 0 -> tokens [B, N] int64, equal to ref.sampling.sample_tokens."""
    b, n, vocab = logits.shape
    out = torch.zeros((b, n), dtype=torch.int64, device=logits.device)
    if b * n == 0 or vocab == 0:
        return out
    block = min(4096, triton.next_power_of_2(vocab))
    _sample_kernel[(b * n,)](
        logits.contiguous(),
        noise.contiguous(),
        cutoffs.contiguous(),
        out,
        vocab,
        temperature,
        BLOCK=block,
        NT=triton.cdiv(vocab, block),
        num_warps=8,
    )
    return out
