"""Where two greedy outputs of the same target parted, and whether a near-tie explains it.

Greedy DDTree commits the target's argmax at every position, as autoregressive decoding does, but in
bf16 a verify forward of N tokens and a decode step of one round differently: where the target's two
best logits are within that rounding, the two runs may pick different tokens and then continue from
different prefixes. `explain` finds the first differing position per request, recomputes the target's
logits there (one forward of the common prefix) and calls the divergence a tie when the two chosen
tokens' logits are within `TIE_ULPS` units of the dtype's rounding of the largest logit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_ULPS = 16  # rounding differences accumulate over layers; float32 and float64 keep this tight


@dataclass(frozen=True)
class Divergence:
    """Request `request` parted at new token `position`: `expected` (the reference run) against `got`.
    margin: logit[expected] - logit[got] recomputed at that position; tolerance: what rounding explains."""

    request: int
    position: int
    expected: int
    got: int
    margin: float
    tolerance: float

    @property
    def tie(self) -> bool:
        return abs(self.margin) <= self.tolerance

    def describe(self) -> str:
        verdict = "a near-tie that rounding explains" if self.tie else "NOT explained by a tie"
        return (
            f"request {self.request}: parted at new token {self.position} ({self.expected} vs {self.got}); "
            f"logit gap {self.margin:.4g}, tolerance {self.tolerance:.3g}: {verdict}"
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a length difference counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """TIE_ULPS units of dtype's rounding at the largest |logit|."""
    return TIE_ULPS * torch.finfo(dtype).eps * float(logits.abs().max())


@torch.no_grad()
def explain(target, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]], impl=None):
    """-> [Divergence] for every request whose outputs differ (where one output merely stops early, the
    margin is 0 and the tolerance infinite: a stop, not a choice)."""
    out = []
    for r, (prompt, a, b) in enumerate(zip(prompts, expected, got)):
        i = first_difference(a, b)
        if i is None:
            continue
        if i >= min(len(a), len(b)):
            out.append(
                Divergence(r, i, a[i] if i < len(a) else -1, b[i] if i < len(b) else -1, 0.0, float("inf"))
            )
            continue
        prefix = torch.tensor([list(prompt) + a[:i]], dtype=torch.int64, device=target.device)
        cache = target.new_cache(1, prefix.shape[1])
        rows = torch.tensor([prefix.shape[1] - 1], device=target.device)
        logits = target(prefix, cache, impl=impl, logits_rows=rows).logits[0, 0]
        margin = float(logits[a[i]] - logits[b[i]])
        out.append(Divergence(r, i, a[i], b[i], margin, tolerance(logits, target.dtype)))
    return out
