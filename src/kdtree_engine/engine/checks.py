"""Validation at generate()'s boundary of what needs the models (GenerationConfig checks itself).
Every failure is a ValueError naming the argument."""

from __future__ import annotations

import numbers

import torch


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def describe(x) -> str:
    """What was passed, for an error: None, a builtin's type name, or module.Class."""
    if x is None:
        return "None"
    cls = type(x)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


TARGET_NEEDS = ("config", "lm_head", "embed_tokens", "new_cache")
TARGET_CONFIG_NEEDS = ("vocab_size", "hidden_size", "num_hidden_layers")
DRAFTER_NEEDS = ("block_size", "target_layer_ids", "new_cache", "draft")


def _interface_error(name: str, expected: str, x, needs: tuple[str, ...]) -> ValueError | None:
    """The error for an object that lacks some of `needs`, listing them unless it lacks them all."""
    missing = [n for n in needs if not hasattr(x, n)]
    if not missing:
        return None
    detail = f" (it has no {', '.join(missing)})" if len(missing) < len(needs) else ""
    return ValueError(f"{name}: expected {expected}, got {describe(x)}{detail}")


TARGET_EXPECTED = (
    "the target model, a kdtree_engine.model.DeepseekV3ForCausalLM (e.g. from kdtree_engine.model.load_model)"
)
DRAFTER_EXPECTED = (
    "a DFlash drafter, a kdtree_engine.drafter.DFlashDrafter (e.g. from kdtree_engine.drafter.load_drafter)"
)


def check_target(target) -> None:
    """target: a kdtree_engine.model DeepseekV3ForCausalLM, or anything with its interface (callable,
    with config (vocab_size, hidden_size, num_hidden_layers), lm_head, embed_tokens and new_cache)."""
    error = _interface_error("target", TARGET_EXPECTED, target, TARGET_NEEDS + ("__call__",))
    if error is not None:
        raise error
    missing = [n for n in TARGET_CONFIG_NEEDS if not hasattr(target.config, n)]
    if missing:
        listing = ", ".join(missing)
        raise ValueError(
            f"target: expected {TARGET_EXPECTED}, got {describe(target)} whose config has no {listing}"
        )


def check_prompts(prompts, vocab_size: int, context_len: int | None) -> list[list[int]]:
    """prompts: a list of token-id lists (ragged), a single list of ints, or an int tensor [B, T] / [T]."""
    if isinstance(prompts, torch.Tensor):
        if prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool:
            raise ValueError(f"prompts: expected integer token ids, got dtype {prompts.dtype}")
        if prompts.dim() not in (1, 2):
            raise ValueError(f"prompts: expected a tensor [B, T] or [T], got shape {tuple(prompts.shape)}")
        prompts = prompts.tolist()
        if prompts and is_int(prompts[0]):
            prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(
            "prompts: expected a non-empty list of prompts (lists of token ids), got "
            + (
                f"an empty {type(prompts).__name__}"
                if isinstance(prompts, (list, tuple))
                else describe(prompts)
            )
        )
    if all(is_int(t) for t in prompts):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not all(is_int(t) for t in p):
            raise ValueError(f"prompts: prompt {i} must be a list of int token ids, got {describe(p)}")
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
    """The target (check_target), and for a method other than "autoregressive" a drafter: a DFlash
    drafter or anything with its interface (block_size, target_layer_ids, new_cache, draft), not the
    target; drafter and target must agree: hidden size (the drafter embeds with the target's table and
    feeds the target's lm_head), vocabulary, and target layer ids within the target's layers."""
    check_target(target)
    if method == "autoregressive":
        return
    if drafter is None:
        raise ValueError(f"drafter: method {method!r} needs a drafter: {DRAFTER_EXPECTED}, got None")
    if drafter is target:
        raise ValueError(
            f"drafter: got the target model itself ({describe(drafter)}); method {method!r} needs "
            f"{DRAFTER_EXPECTED}"
        )
    error = _interface_error("drafter", DRAFTER_EXPECTED, drafter, DRAFTER_NEEDS)
    if error is not None:
        raise error
    tcfg, dcfg = target.config, getattr(drafter, "config", None)
    try:
        ids = tuple(drafter.target_layer_ids)
    except TypeError:
        ids = None
    if ids is None or not all(is_int(i) for i in ids):
        raise ValueError(
            f"drafter: target_layer_ids must be a sequence of ints, got {drafter.target_layer_ids!r}"
        )
    if not ids:
        raise ValueError("drafter: target_layer_ids is empty")
    bad = [i for i in ids if not 0 <= int(i) < tcfg.num_hidden_layers]
    if bad:
        raise ValueError(
            f"drafter: target_layer_ids {bad} out of range for a target with {tcfg.num_hidden_layers} layers"
        )
    if not is_int(drafter.block_size) or drafter.block_size < 2:
        raise ValueError(f"drafter: block_size must be an int >= 2, got {drafter.block_size!r}")
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
