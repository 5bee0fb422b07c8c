"""Sizes of a generate() call, known before anything is allocated or loaded: each request's token
limit, the cache rows, and the largest buffers, from the models' configs alone (a checkpoint's
config.json is enough). `generate` checks them against the free memory before its first allocation,
and `kdtree-engine generate` before it loads the weights (`engine.checks.check_memory`).

The needs are keyed by the GenerationConfig field (or argument) that sizes them, so that the error
names what to lower: `max_new_tokens` (the target's latent cache and the drafter's cache), `budget`
(a verify forward: logits, absorbed queries, the ancestor mask and, with the reference attention,
its float32 scores, 3 x h x N x S per request for N tree nodes over S cache rows), `method` (the
draft logits), `prompts` (the prefill's reference attention scores) and, for the command, `dtype`
(the weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kdtree_engine.engine.checks import check_memory
from kdtree_engine.impl import resolve_impl
from kdtree_engine.tree.validate import check_budget

Needs = dict[str, tuple[str, int]]  # field -> (what needs the memory: a singular subject, bytes)
SCORE_COPIES = 3  # the reference attention holds the scores, their masked copy and the softmax at once


def request_limits(prompt_lengths: Sequence[int], max_new_tokens: int, context: int | None) -> list[int]:
    """New tokens per request at most: max_new_tokens, clamped to the target's context (positions <
    context) minus the prompt."""
    if context is None:
        return [max_new_tokens] * len(prompt_lengths)
    return [max(0, min(max_new_tokens, context - n)) for n in prompt_lengths]


def cache_rows(
    prompt_lengths: Sequence[int], limits: Sequence[int], method: str, budget: int, block_size: int
) -> int:
    """Cache rows per request: the longest prompt + limit, plus the margin the rounds after a request's
    last token may write: the round that commits the last token may commit a block more, the round
    enqueued ahead of the host's reading (engine.loop) commits up to another block, and the rounds after
    it write a whole tree without committing it."""
    margin = 4 if method == "autoregressive" else budget + 2 * block_size + 2
    return max(n + limit for n, limit in zip(prompt_lengths, limits)) + margin


def _scores(heads: int, rows: int, cols: int, itemsize: int) -> int:
    """Bytes of the reference attention of one request: float32 (or wider) scores [rows, heads, cols],
    SCORE_COPIES of them, plus the [rows, cols] bool mask."""
    return SCORE_COPIES * rows * heads * cols * max(itemsize, 4) + rows * cols


def generation_needs(
    model_config,
    dtype: torch.dtype,
    *,
    prompt_lengths: Sequence[int],
    max_len: int,
    budget: int,
    block_size: int,
    reference_attention: bool,
    drafter_config=None,
) -> Needs:
    """The largest buffers of one generate() call, by the field that sizes them (see the module
    docstring). model_config: the target's ModelConfig; block_size 1 means no drafter (autoregressive);
    drafter_config: a DFlashConfig (its cache), or None; reference_attention: the attention runs the
    torch reference (impl "ref", every CPU run), which materializes the scores."""
    c, item = model_config, dtype.itemsize
    batch, nodes = len(prompt_lengths), budget + 1
    cache = c.num_hidden_layers * batch * max_len * c.latent_dim * item
    if drafter_config is not None and block_size > 1:
        d = drafter_config
        rows = max_len + d.block_size
        cache += 2 * d.num_hidden_layers * batch * rows * d.num_key_value_heads * d.head_dim * item
    # logits in the model dtype and float32, the absorbed queries (twice), the ancestor mask
    verify = batch * nodes * c.vocab_size * (item + 4)
    verify += 2 * batch * nodes * c.num_attention_heads * c.latent_dim * item
    verify += batch * nodes * nodes
    needs: Needs = {"max_new_tokens": (f"caching {max_len} rows per request", cache)}
    if reference_attention:
        verify += _scores(c.num_attention_heads, nodes, max_len, item)
        longest = max(prompt_lengths)
        needs["prompts"] = ("the prefill's attention", _scores(c.num_attention_heads, longest, longest, item))
    needs["budget"] = ("a verify forward", verify)
    if block_size > 1:
        needs["method"] = ("drafting", batch * (block_size - 1) * c.vocab_size * 4 * 2)
    return needs


@dataclass(frozen=True)
class CallSizes:
    """What a generate() call sizes from the configs alone: limits [B] new tokens per request at most,
    budget the tree nodes per round (checked against what a tree op builds), max_len the cache rows per
    request, needs its largest buffers by field (generation_needs); rows the most a request's own tokens
    fill (prompt + limit; max_len less the rounds' margin)."""

    limits: list[int]
    budget: int
    max_len: int
    needs: Needs
    rows: int = 0


def call_sizes(
    model_config, dtype: torch.dtype, config, prompt_lengths: Sequence[int], block_size: int, device,
    drafter_config=None,
) -> CallSizes:  # fmt: skip
    """The sizes of one generate() call with `config` (its method included) on `device`: the one
    computation behind generate()'s check and the command's check before loading. block_size: the
    drafter's, 1 for "autoregressive"."""
    budget = check_budget(config.tree_budget(block_size))  # what a tree op builds
    context = getattr(model_config, "max_position_embeddings", None)
    limits = request_limits(prompt_lengths, config.max_new_tokens, context)
    max_len = cache_rows(prompt_lengths, limits, config.method, budget, block_size)
    needs = generation_needs(
        model_config,
        dtype,
        prompt_lengths=prompt_lengths,
        max_len=max_len,
        budget=budget,
        block_size=block_size,
        reference_attention=resolve_impl(config.impl, torch.device(device)) == "ref",
        drafter_config=drafter_config,
    )
    rows = max(n + limit for n, limit in zip(prompt_lengths, limits))
    return CallSizes(limits, budget, max_len, needs, rows)


def weights_bytes(model_config, dtype: torch.dtype, drafter_config=None) -> int:
    """Bytes of the target's (and the drafter's) parameters and buffers in dtype, counted on the meta
    device (nothing is allocated)."""
    from kdtree_engine.model.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        modules = [DeepseekV3ForCausalLM(model_config)]
        if drafter_config is not None:
            from kdtree_engine.drafter.model import DFlashDrafter

            modules.append(DFlashDrafter(drafter_config))
    count = sum(t.numel() for m in modules for t in (*m.parameters(), *m.buffers()))
    return count * dtype.itemsize


def clamp_note(max_new_tokens: int, prompt_lengths: Sequence[int], context: int | None) -> str:
    """The line that says max_new_tokens is clamped to the context (request_limits), or "" when every
    request has room for it."""
    limits = request_limits(prompt_lengths, max_new_tokens, context)
    if min(limits) >= max_new_tokens:
        return ""
    r = limits.index(min(limits))
    return (
        f"max_new_tokens: {max_new_tokens} is past the target's context of {context} positions; each "
        f"request stops at its end (request {r}: {prompt_lengths[r]} prompt tokens, at most {limits[r]} new)"
    )


def check_memory_before_loading(
    checkpoints, config, prompt_lengths: Sequence[int], methods: Sequence[str], dtype: torch.dtype, device
) -> None:
    """For each method to run: its tree budget against what a tree op builds, then its caches and
    largest buffers plus the weights (engine.checkpoint's Checkpoints: the configs, no weight read yet)
    against the free memory of device; a ValueError naming the field to lower (checks.check_memory;
    "dtype" when the weights are the largest)."""
    cfg, where = checkpoints.target_config, torch.device(device)
    drafter_config = checkpoints.drafter_config if list(methods) != ["autoregressive"] else None
    weights = (
        f"loading the weights in {str(dtype).removeprefix('torch.')}",
        weights_bytes(cfg, dtype, drafter_config),
    )
    for method in methods:
        block = checkpoints.block_size if method != "autoregressive" else 1
        sizes = call_sizes(
            cfg, dtype, replace(config, method=method), prompt_lengths, block, where, drafter_config
        )
        check_memory(where, {**sizes.needs, "dtype": weights})


__all__ = [
    "CallSizes",
    "Needs",
    "cache_rows",
    "call_sizes",
    "check_memory_before_loading",
    "clamp_note",
    "generation_needs",
    "request_limits",
    "weights_bytes",
]
