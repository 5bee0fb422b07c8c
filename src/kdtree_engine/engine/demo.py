"""The no-download demo: a seeded tiny random DeepSeek-V3 target and a drafter for it.

A random target has no trained drafter, so the demo's default drafter is a labelled stand-in,
`NoisyOracleDrafter`: it is handed the target's greedy continuation (computed up front by plain
autoregressive decoding) and ranks the true next token first most of the time, second, third or not in
its top four otherwise. That is the situation DDTree is built for: a single DFlash chain stops at the
first miss of rank 0, the tree keeps the runners-up. `--demo-drafter random` uses a real, randomly
initialized DFlash drafter instead (it accepts almost nothing, but exercises the whole architecture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config

DEMO_PROMPT = [1, 17, 42, 5, 99, 23, 64, 8]


def demo_target(device="cpu", dtype=torch.float32):
    from kdtree_engine.model import random_model, tiny_config

    return random_model(tiny_config(), seed=0, dtype=dtype, device=device)


@dataclass
class RequestRows:
    """A drafter "cache" that only tracks which request each batch row is (rows are dropped as
    requests finish), for drafters that look requests up by index."""

    rows: list[int]

    def select(self, index: torch.Tensor) -> RequestRows:
        return RequestRows([self.rows[i] for i in index.tolist()])


class NoisyOracleDrafter:
    """Drafter interface (block_size, target_layer_ids, new_cache, draft) over known continuations.

    sequences: per request, prompt + the target's greedy continuation. The true token at position p gets
    rank 0 with probability p_rank[0], rank 1 with p_rank[1], ..., and falls outside the top ranks with
    the remaining probability (decided by a hash of (seed, p), so it is reproducible)."""

    def __init__(
        self,
        sequences: list[list[int]],
        vocab_size: int,
        block_size: int = 16,
        p_rank=(0.7, 0.15, 0.1),
        seed: int = 0,
    ) -> None:
        self.sequences, self.vocab, self.block_size = sequences, vocab_size, block_size
        self.target_layer_ids = (0,)
        self.cum = torch.tensor(p_rank).cumsum(0)
        self.seed = seed

    def new_cache(self, batch_size: int, max_len: int) -> RequestRows:
        return RequestRows(list(range(batch_size)))

    def _rank(self, pos: int) -> int:
        u = torch.rand(1, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + pos)).item()
        return int((self.cum <= u).sum())  # == len(p_rank) means "not in the top ranks"

    def _row(self, seq: list[int], pos: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 7919 + pos)
        logits = torch.randn(self.vocab, generator=gen) - 8.0
        order = torch.randperm(self.vocab, generator=gen)
        if pos < len(seq):
            true = seq[pos]
            order = order[order != true]
            order = torch.cat([order[: self._rank(pos)], torch.tensor([true]), order[self._rank(pos) :]])
        for r, tok in enumerate(order[: len(self.cum) + 1].tolist()):
            logits[tok] = 4.0 - 0.7 * r
        return logits

    def draft(self, target, context, context_lens, bonus, start, cache) -> torch.Tensor:
        depth = self.block_size - 1
        rows = [
            self._row(self.sequences[b], s + i)
            for b, s in enumerate(start.tolist())
            for i in range(1, depth + 1)
        ]
        return torch.stack(rows).view(len(rows) // depth, depth, self.vocab).to(bonus.device)


def demo_drafter(kind: str, target, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16):
    """kind "oracle" (NoisyOracleDrafter) or "random" (a seeded random DFlashDrafter)."""
    if kind == "random":
        cfg = tiny_drafter_config(target.config, block_size=block_size)
        return random_drafter(cfg, seed=1, dtype=target.dtype, device=target.device)
    if kind != "oracle":
        raise ValueError(f"demo_drafter: kind must be 'oracle' or 'random', got {kind!r}")
    from kdtree_engine.model import greedy_generate

    cont = greedy_generate(target, prompts, max_new_tokens + block_size + 1)
    seqs = [list(p) + c for p, c in zip(prompts, cont)]
    return NoisyOracleDrafter(seqs, target.config.vocab_size, block_size)


__all__ = ["DEMO_PROMPT", "NoisyOracleDrafter", "RequestRows", "demo_drafter", "demo_target"]
