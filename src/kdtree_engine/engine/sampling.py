"""Choosing the target's token at every position: argmax (temperature 0) or an independent sample from
the tempered, top-k and top-p filtered distribution, both through the tree package's accept ops.

Sampled mode draws with `accept_sampled`'s counter-based noise: the noise of a draw is a function of
(seed, offset, row, node, token id), so the kernel never materializes [B, N, V] noise, the reference and
the kernel pick the same tokens, and a run is reproducible from its seed. The loop uses one offset per
draw (prefill, then one per round), so no (offset, row, node) is ever reused within a run."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from kdtree_engine.ref.sampling import sampling_cutoffs
from kdtree_engine.tree import AcceptResult, DraftTree, accept_greedy, accept_sampled


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0, got {self.top_k!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] float32: softmax(logits / temperature) over the tokens
    at or above the cutoff of ref.sampling.sampling_cutoffs (top-k, then the smallest set of most
    probable tokens whose mass reaches top_p; tokens tied with the cutoff are kept). This is the
    distribution accept_sampled draws from."""
    x = logits.float()
    flat = x.reshape(1, -1, x.shape[-1])
    cut = sampling_cutoffs(flat, params.temperature, params.top_k, params.top_p).reshape(x.shape[:-1])
    scaled = (x / params.temperature).masked_fill(x < cut[..., None], float("-inf"))
    return torch.softmax(scaled, dim=-1)


def root_tree(batch: int, device: torch.device | str) -> DraftTree:
    """A batch of root-only trees (budget 0): accepting on it picks one token per request."""
    empty = torch.zeros((batch, 0), dtype=torch.int64, device=device)
    parents = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    return DraftTree(empty, empty, parents, torch.zeros(batch, dtype=torch.int64, device=device), 0)


def accept_tokens(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int,
    offset: int | None,
    impl=None,
    stream_keys: torch.Tensor | None = None,
) -> AcceptResult:
    """logits [B, N, V] (N = budget + 1) -> AcceptResult: the target's token at every node is its argmax
    (greedy) or a sample drawn with accept_sampled's seeded noise, keyed by (seed, offset) or by the
    device-resident stream_keys of (seed, offset) (offset None then); then the tree walk."""
    if params.greedy:
        return accept_greedy(
            tree, logits.argmax(dim=-1), impl=impl, validate=False
        )  # argmax ids are in range
    keyed = dict(stream_keys=stream_keys) if stream_keys is not None else dict(seed=seed, offset=offset)
    acc, _ = accept_sampled(
        tree,
        logits,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        impl=impl,
        validate=False,  # the target's own logits, every round: no value check, no host sync
        **keyed,
    )
    return acc
