"""The no-download demos: the shipped kimi-nano's prompt choice (`kimi_nano_prompt`, `as_training_text`),
and `--demo random`: a seeded tiny random DeepSeek-V3 target and a drafter for it.

A random target has no trained drafter, so the demo's default drafter is a labelled stand-in,
`NoisyOracleDrafter`: it is handed the target's greedy continuation (computed up front by plain
autoregressive decoding) and ranks the true next token first 70% of the time, second 15%, third 10%
and fourth 5%, on the device. That is the situation DDTree is built for: a single DFlash chain stops at the
first miss of rank 0, the tree keeps the runners-up. `--demo-drafter random` uses a real, randomly
initialized DFlash drafter instead (it accepts almost nothing, but exercises the whole architecture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config

DEMO_PROMPT = [1, 17, 42, 5, 99, 23, 64, 8]


def kimi_nano_prompt(index: int = 0) -> tuple[str, str]:
    """(text, intro): kimi-nano's held-out code-completion prompt `index` and the lines that present
    it. It ends with a def line, before its newline, as training text goes on, so the model writes the
    body (assets.heldout_prompts)."""
    from kdtree_engine.assets import heldout_prompts

    prompt = heldout_prompts()[index]
    intro = (
        f"--- prompt: code from a file held out of kimi-nano's training ({prompt['source']}); it ends with a "
        "def line, before its newline, as training text goes on: the model writes the body ---\n"
        f"{prompt['text']}"
    )
    return prompt["text"], intro


def as_training_text(text: str) -> str:
    """A kimi-nano text prompt without the newlines at its end: its BPE merges a newline with the next
    line's indentation, so no training text has a bare newline before a body, and after one the model
    skips the body. A prompt of newlines only is left alone."""
    return text.rstrip("\n") if text.strip() else text


def demo_target(device="cpu", dtype=torch.float32):
    from kdtree_engine.model import random_model, tiny_config

    return random_model(tiny_config(), seed=0, dtype=dtype, device=device)


@dataclass
class RequestRows:
    """A drafter "cache" that only tracks which request each batch row is, for drafters that look
    requests up by index."""

    rows: list[int]


@dataclass
class RequestIndex:
    """The device-resident twin of RequestRows: index [B] int64, the request of each batch row."""

    index: torch.Tensor


class NoisyOracleDrafter:
    """A drafter stand-in over known continuations, entirely on the device (no host reads, so a round
    that calls it can be captured in a CUDA graph). Interface: block_size, target_layer_ids, new_cache,
    draft.

    sequences: per request, prompt + the target's greedy continuation. At position p the true token
    gets rank r(p) among the top len(p_rank) + 1 drafted tokens, with r = 0 with probability p_rank[0],
    1 with p_rank[1], ..., and len(p_rank) otherwise (r(p) is drawn once from `seed`, the same for every
    request). The ranked tokens get logits 4.0 - 0.7 r; the rest of the vocabulary gets seeded noise
    around -8 (a table of `noise_rows` random rows, row p mod noise_rows at position p). Past the end of
    a sequence all ranked tokens are decoys. Acceptance therefore follows a fixed, documented profile:
    the stand-in measures the engine, not a drafter."""

    def __init__(
        self,
        sequences: list[list[int]],
        vocab_size: int,
        block_size: int = 16,
        p_rank=(0.7, 0.15, 0.1),
        seed: int = 0,
        device="cpu",
        noise_rows: int = 16,
    ) -> None:
        self.capturable = True  # draft() reads no tensor on the host
        ranked = len(p_rank) + 1
        if vocab_size < ranked + 2:
            raise ValueError(f"vocab_size: the oracle stand-in needs at least {ranked + 2} tokens")
        self.vocab, self.block_size, self.target_layer_ids = vocab_size, block_size, (0,)
        gen = torch.Generator().manual_seed(seed)
        span = max(len(s) for s in sequences) + block_size + 1
        true = torch.randint(0, vocab_size, (len(sequences), span), generator=gen)
        for b, seq in enumerate(sequences):
            true[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
        known = torch.arange(span)[None, :] < torch.tensor([len(s) for s in sequences])[:, None]
        u = torch.rand(span, generator=gen)
        rank = (torch.tensor(p_rank).cumsum(0)[None, :] <= u[:, None]).sum(1)  # [span]
        # ranked + 1 distinct decoys per position, none equal to the true token
        shift = torch.randint(0, vocab_size - ranked - 1, (len(sequences), span, 1), generator=gen)
        decoys = (true[..., None] + 1 + shift + torch.arange(ranked)) % vocab_size  # [B, span, ranked]
        slot = torch.arange(ranked)
        at_rank = (slot[None, None, :] == rank[None, :, None]) & known[..., None]
        self.top = torch.where(at_rank, true[..., None], decoys).to(device)  # [B, span, ranked]
        self.top_logits = (4.0 - 0.7 * slot.float()).to(device)  # [ranked]
        self.noise = (torch.randn(noise_rows, vocab_size, generator=gen) - 8.0).to(device)

    def new_cache(self, batch_size: int, max_len: int) -> RequestIndex:
        return RequestIndex(torch.arange(batch_size, device=self.noise.device))

    def draft(self, target, context, context_lens, bonus, start, cache, impl=None) -> torch.Tensor:
        """Draft logits [B, L, V] float32 for positions start + 1 .. start + L."""
        depth = self.block_size - 1
        span = self.top.shape[1]
        pos = start[:, None] + torch.arange(1, depth + 1, device=start.device)  # [B, L]
        logits = self.noise[pos % self.noise.shape[0]]  # [B, L, V]
        tokens = self.top[cache.index[:, None], pos.clamp(max=span - 1)]  # [B, L, ranked]
        return logits.scatter_(2, tokens, self.top_logits.expand_as(tokens).contiguous())


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
    return NoisyOracleDrafter(seqs, target.config.vocab_size, block_size, device=target.device)


__all__ = [
    "DEMO_PROMPT",
    "NoisyOracleDrafter",
    "RequestIndex",
    "RequestRows",
    "as_training_text",
    "demo_drafter",
    "demo_target",
    "kimi_nano_prompt",
]
