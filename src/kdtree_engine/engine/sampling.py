"""Choosing the target's token at every position: argmax (temperature 0) or an independent sample from
the tempered, top-k and top-p filtered distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] float32 after temperature, top-k then top-p (the
    smallest set of most probable tokens whose mass reaches top_p; the top token is always kept)."""
    logits = logits.float() / params.temperature
    v = logits.shape[-1]
    if 0 < params.top_k < v:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def pick_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, N, V] -> tokens [B, N] int64: argmax (first maximum on ties) when greedy, else one
    independent draw per position."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, params)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
