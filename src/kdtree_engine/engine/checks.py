"""Validation at generate()'s boundary of what needs the models (GenerationConfig checks itself).
Every failure is a ValueError naming the argument."""

from __future__ import annotations

import numbers

import torch


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_prompts(prompts, vocab_size: int, context_len: int | None) -> list[list[int]]:
    """prompts: a list of token-id lists (ragged), a single list of ints, or an int tensor [B, T] / [T]."""
    if isinstance(prompts, torch.Tensor):
        if prompts.is_floating_point():
            raise ValueError(f"prompts: expected integer token ids, got dtype {prompts.dtype}")
        prompts = prompts.tolist()
        if prompts and is_int(prompts[0]):
            prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a non-empty list of prompts (lists of token ids)")
    if all(is_int(t) for t in prompts):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not all(is_int(t) for t in p):
            raise ValueError(f"prompts: prompt {i} must be a list of int token ids")
        if len(p) == 0:
            raise ValueError(f"prompts: prompt {i} is empty (at least one token is needed)")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompts: prompt {i} has token ids outside [0, {vocab_size})")
        if context_len is not None and len(p) >= context_len:
            raise ValueError(
                f"prompts: prompt {i} has {len(p)} tokens, longer than the target's context "
                f"of {context_len} minus one generated token"
            )
        out.append([int(t) for t in p])
    return out


def check_drafter(target, drafter, method: str) -> None:
    """A method other than "autoregressive" needs a drafter, and drafter and target must agree: hidden
    size (the drafter embeds with the target's table and feeds the target's lm_head), vocabulary, and
    target layer ids within the target's layers."""
    if method == "autoregressive":
        return
    if drafter is None:
        raise ValueError(f"drafter: method {method!r} needs a drafter")
    tcfg, dcfg = target.config, getattr(drafter, "config", None)
    ids = tuple(drafter.target_layer_ids)
    if not ids:
        raise ValueError("drafter: target_layer_ids is empty")
    bad = [i for i in ids if not 0 <= int(i) < tcfg.num_hidden_layers]
    if bad:
        raise ValueError(
            f"drafter: target_layer_ids {bad} out of range for a target with {tcfg.num_hidden_layers} layers"
        )
    if getattr(drafter, "block_size", 0) < 2:
        raise ValueError(f"drafter: block_size must be >= 2, got {getattr(drafter, 'block_size', None)}")
    if dcfg is None:
        return
    if dcfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"drafter: hidden_size {dcfg.hidden_size} != target hidden_size {tcfg.hidden_size}")
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"drafter: vocab_size {dcfg.vocab_size} != target vocab_size {tcfg.vocab_size}")


def check_stop_tokens(stop_tokens: tuple[int, ...], vocab_size: int) -> frozenset[int]:
    stops = frozenset(stop_tokens)
    if any(not 0 <= t < vocab_size for t in stops):
        raise ValueError(f"stop_tokens: ids must be in [0, {vocab_size})")
    return stops


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on device: the CUDA allocator's free memory plus what torch already
    holds in its cache, or the host's available memory (Linux), or None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_memory(device: torch.device, needs: dict[str, tuple[str, int]]) -> None:
    """needs: field -> (what, bytes) for the largest tensors a call will allocate. ValueError naming the
    field of the largest need when together they exceed the free memory (checked before allocating)."""
    free = available_memory(device)
    total = sum(b for _, b in needs.values())
    if free is None or total <= free:
        return
    field, (what, size) = max(needs.items(), key=lambda kv: kv[1][1])
    raise ValueError(
        f"{field}: {what} needs about {size / 2**30:.1f} GiB (all buffers {total / 2**30:.1f} GiB) but "
        f"{free / 2**30:.1f} GiB are free on {device}; lower it"
    )
