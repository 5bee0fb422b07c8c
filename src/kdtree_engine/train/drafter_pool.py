"""The pool a DFlash drafter trains on: seeded random windows of `prompt_len` tokens of a token file,
each continued by the TARGET for `new_tokens` tokens (argmax, or a fraction sampled at temperature 1),
so the drafter learns what the target will verify. Every pooled sequence then goes through one target
forward that captures the drafter's `target_layer_ids`: the features X [S, F] are exactly the tensor the
engine hands the drafter as `context` (the concatenated outputs of those decoder layers, see
engine/loop.py).

Dimension names: S = prompt_len + new_tokens rows, H target hidden, F = len(target_layer_ids) * H,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Pool", "PoolSpec", "build_pool", "continue_prompts", "sample_windows", "target_features"]


@dataclass(frozen=True)
class PoolSpec:
    """How a pool is built: `sequences` windows of `prompt_len` source tokens, each continued by the
    target for `new_tokens` tokens; the first round(sampled_fraction * sequences) rows are sampled at
    temperature 1, the others greedy; `batch` rows per target forward."""

    sequences: int
    prompt_len: int
    new_tokens: int
    sampled_fraction: float = 0.0
    batch: int = 512

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def num_sampled(self) -> int:
        return int(round(self.sequences * self.sampled_fraction))


@dataclass
class Pool:
    """tokens [N, S] int64 and features [N, S, F] (the target's captured layers, its dtype) on the
    device; rows >= prompt_len of tokens are the target's own continuation."""

    tokens: torch.Tensor
    features: torch.Tensor
    prompt_len: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


def sample_windows(source: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`count` windows of `length` consecutive tokens of `source` at seeded random offsets (they may
    cross document boundaries, as the target saw in training) -> [count, length] int64."""
    if len(source) < length:
        raise ValueError(f"source: {len(source)} tokens, fewer than one window of {length}")
    starts = rng.integers(0, len(source) - length + 1, size=count)
    return np.asarray(source[starts[:, None] + np.arange(length)], dtype=np.int64)


def _next_tokens(logits: torch.Tensor, sampled: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """logits [b, V] -> [b] argmax, or for rows with sampled[b] a draw at temperature 1."""
    greedy = logits.argmax(-1)
    if sampled is None:
        return greedy
    drawn = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen)[:, 0]
    return torch.where(sampled, drawn, greedy)


@torch.no_grad()
def continue_prompts(
    target, prompts: torch.Tensor, new_tokens: int, sampled: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """prompts [b, P] int64 on the target's device -> [b, P + new_tokens]: each row continued by the
    target on its latent cache (one prefill, then one decode forward per token), greedy or, where
    sampled [b] bool, at temperature 1 with `gen` (a generator on the target's device)."""
    b, p = prompts.shape
    cache = target.new_cache(b, p + new_tokens)
    last = torch.full((b,), p - 1, dtype=torch.int64, device=prompts.device)
    logits = target(prompts, cache, logits_rows=last, validate=False).logits[:, 0]
    sampled = sampled if bool(sampled.any()) else None
    out = [prompts]
    for i in range(new_tokens):
        token = _next_tokens(logits, sampled, gen)
        out.append(token[:, None])
        if i + 1 < new_tokens:
            logits = target(token[:, None], cache, validate=False).logits[:, -1]
    return torch.cat(out, dim=1)


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """tokens [b, S] -> the drafter's context features [b, S, F]: one target forward over the whole
    sequence capturing `layers` (the same tensor the engine passes the drafter as `context`)."""
    b, s = tokens.shape
    cache = target.new_cache(b, s)
    first = torch.zeros(b, dtype=torch.int64, device=tokens.device)  # skip the [b, S, V] projection
    out = target(tokens, cache, capture_layers=layers, logits_rows=first, validate=False)
    return out.hidden


def _prompt_windows(target, source: np.ndarray, spec: PoolSpec, seed: int) -> np.ndarray:
    """The pool's seeded prompt windows [sequences, prompt_len]; ValueError for a token id the target's
    vocabulary lacks."""
    windows = sample_windows(source, spec.sequences, spec.prompt_len, np.random.default_rng(seed))
    vocab = target.config.vocab_size
    if windows.size and int(windows.max()) >= vocab:
        raise ValueError(f"source: token id {int(windows.max())} outside the target vocabulary ({vocab})")
    return windows


def build_pool(
    target, source: np.ndarray, spec: PoolSpec, layers: tuple[int, ...], seed: int, progress: bool = True
) -> Pool:
    """The seeded pool of `spec` from `source` (a uint16 token array): windows, target continuations,
    target features, `spec.batch` rows at a time, kept on the target's device."""
    from tqdm import tqdm

    windows = _prompt_windows(target, source, spec, seed)
    dev = target.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    sampled = torch.arange(spec.sequences, device=dev) < spec.num_sampled
    tokens, features = [], []
    chunks = range(0, spec.sequences, spec.batch)
    for lo in tqdm(chunks, desc="pool", disable=not progress, leave=False):
        hi = min(lo + spec.batch, spec.sequences)
        prompts = torch.from_numpy(windows[lo:hi]).to(dev)
        seqs = continue_prompts(target, prompts, spec.new_tokens, sampled[lo:hi], gen)
        tokens.append(seqs)
        features.append(target_features(target, seqs, layers))
    return Pool(torch.cat(tokens), torch.cat(features), spec.prompt_len)
