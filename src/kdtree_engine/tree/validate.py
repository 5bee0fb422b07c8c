"""Checks at the public boundary of the tree ops. Each failure is a ValueError naming the argument.

Validation reads the data (NaN, sort order, id range), which costs a device sync on CUDA: the engine's
hot loop passes `validate=False` once its inputs are known good.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from kdtree_engine.impl import capturing
from kdtree_engine.ref import tree as ref_tree


def can_read(x: torch.Tensor) -> bool:
    """Whether a data check may read x: not while a CUDA graph is being captured (a read syncs)."""
    return not capturing(x.device)


def as_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, torch.Tensor):
        return x
    raise ValueError(f"{name}: expected a torch.Tensor or numpy array, got {type(x).__name__}")


def check_int(value, name: str, *, minimum: int = 0, maximum: int | None = None, why: str = "") -> int:
    """value as an int in [minimum, maximum] (no upper bound when maximum is None); `why`, when given,
    explains the upper bound in the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        because = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected an int in [{minimum}, {maximum}]{because}, got {value}")
    return int(value)


def check_budget(budget) -> int:
    """The tree budget as an int in [0, ref.tree.MAX_BUDGET], checked before anything is allocated."""
    why = "the most nodes a tree op builds, every impl"
    return check_int(budget, "budget", maximum=ref_tree.MAX_BUDGET, why=why)


def check_rank(x: torch.Tensor, name: str, rank: int, dims: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {dims}, got shape {tuple(x.shape)}")


def require_float(x: torch.Tensor, name: str) -> None:
    """Checks the dtype only (no copy: the logits can be gigabytes)."""
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")


def check_float(x: torch.Tensor, name: str) -> torch.Tensor:
    """Checks the dtype and returns x as float32 (a copy unless it already is)."""
    require_float(x, name)
    return x.float()


def check_integer_dtype(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype, got {x.dtype}")
    return x.long()


def check_same_device(named: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must share one device: {listing}")


def index_str(flat: int, shape) -> str:
    """The flat (row-major) index of an element of a tensor of `shape` as "[i, j, ...]"."""
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat, tuple(shape))) + "]"


def check_log_values(x: torch.Tensor, name: str, *, empty_rows: bool) -> None:
    """Logits or log-probs [..., V]: NaN and +inf refused, -inf allowed (a masked token, probability 0);
    with empty_rows=False each row needs a finite value. The good path is one reduction (the row max,
    which propagates NaN) and one host sync; an error names the first offending index."""
    if x.numel() == 0:
        return
    row_max = x.amax(-1)
    bad = torch.isnan(row_max) | (row_max == float("inf"))
    if not empty_rows:
        bad |= row_max == float("-inf")
    if bool(bad.any()):
        _raise_bad_values(x, row_max, name)


def _raise_bad_values(x: torch.Tensor, row_max: torch.Tensor, name: str) -> None:
    """The error of check_log_values: the first NaN, else the first +inf, else the first empty row."""
    for what, rows, find in (
        ("NaN", torch.isnan(row_max), torch.isnan),
        ("+inf", row_max == float("inf"), lambda r: r == float("inf")),
    ):
        if bool(rows.any()):
            row = int(rows.reshape(-1).nonzero()[0])
            col = int(find(x.reshape(-1, x.shape[-1])[row]).nonzero()[0])
            raise ValueError(f"{name}: contains {what} at {index_str(row * x.shape[-1] + col, x.shape)}")
    row = int((row_max == float("-inf")).reshape(-1).nonzero()[0])
    raise ValueError(f"{name}: row {index_str(row, row_max.shape)} has no finite logit (all -inf)")


def check_sampling_logits(x: torch.Tensor, name: str, temperature: float) -> None:
    """Target logits [..., V] that accept_sampled draws from, temperature the float32 value it divides
    by: NaN and +inf refused, and every row must be a distribution: its largest logit divided by the
    temperature (float32, as both impls divide) must not be -inf. The largest logit always passes the
    top-k / top-p filter (the cutoff is a logit of the row, never above its maximum), so this is the
    filtered row holding a token of nonzero probability. One reduction (the row max, which propagates
    NaN) and one host sync; an error names the first offending index."""
    if x.numel() == 0:
        return
    row_max = x.amax(-1)
    # A tensor divisor: torch divides by a Python scalar as a multiply by its reciprocal on CUDA.
    tempered = row_max.float() / torch.full_like(row_max, temperature, dtype=torch.float32)
    bad = torch.isnan(row_max) | (row_max == float("inf")) | (tempered == float("-inf"))
    if not bool(bad.any()):
        return
    if bool((torch.isnan(row_max) | (row_max == float("inf"))).any()):
        _raise_bad_values(x, row_max, name)
    empty = row_max == float("-inf")
    if bool(empty.any()):
        row = int(empty.reshape(-1).nonzero()[0])
        raise ValueError(
            f"{name}: row {index_str(row, row_max.shape)} has no finite logit (all -inf): not a distribution"
        )
    row = int((tempered == float("-inf")).reshape(-1).nonzero()[0])
    top = float(row_max.reshape(-1)[row])
    raise ValueError(
        f"{name}: row {index_str(row, row_max.shape)} is -inf everywhere after dividing by temperature="
        f"{temperature:g} (its largest logit is {top:g}): not a distribution; raise the temperature"
    )


def check_ranges(named: dict[str, tuple[torch.Tensor, int | None]]) -> None:
    """name -> (integer tensor, vocab_size or None): every value >= 0, and < vocab_size when given. All
    tensors are read with one host sync; the error names the argument and its first offending element."""
    named = {n: (t, hi) for n, (t, hi) in named.items() if t.numel()}
    if not named:
        return
    found = []
    for t, hi in named.values():
        flat = t.reshape(-1)
        bad = flat < 0 if hi is None else (flat < 0) | (flat >= hi)
        first = bad.to(torch.uint8).argmax().reshape(1)  # the first True: argmax takes the first maximum
        found.append(torch.cat([bad.any().long().reshape(1), first, flat.gather(0, first).long()]))
    for (name, (t, hi)), (any_bad, first, value) in zip(named.items(), torch.stack(found).tolist()):
        if any_bad:
            want = ">= 0" if hi is None else f"in [0, vocab_size={hi})"
            raise ValueError(f"{name}: expected values {want}, got {value} at {index_str(first, t.shape)}")


def check_sorted_desc(x: torch.Tensor, name: str) -> None:
    if x.shape[-1] > 1 and not bool((x[..., 1:] <= x[..., :-1]).all()):
        raise ValueError(f"{name}: each row must be sorted in descending order")


def check_id_range(ids: torch.Tensor, name: str, vocab_size: int | None) -> None:
    if ids.numel() == 0:
        return
    if bool((ids < 0).any()):
        raise ValueError(f"{name}: token ids must be >= 0")
    if vocab_size is not None and bool((ids >= vocab_size).any()):
        raise ValueError(f"{name}: token ids must be < vocab_size={vocab_size}")


def check_topk_inputs(top_logprobs, top_ids, vocab_size: int | None, validate: bool):
    """Returns (top_logprobs [B, L, K] float32, top_ids [B, L, K] int64); a rank-2 pair is batched."""
    lp = as_tensor(top_logprobs, "top_logprobs")
    ids = as_tensor(top_ids, "top_ids")
    if lp.dim() == 2:
        lp = lp.unsqueeze(0)
    if ids.dim() == 2:
        ids = ids.unsqueeze(0)
    check_rank(lp, "top_logprobs", 3, "[B, L, K]")
    check_rank(ids, "top_ids", 3, "[B, L, K]")
    if lp.shape != ids.shape:
        raise ValueError(f"top_ids: shape {tuple(ids.shape)} does not match top_logprobs {tuple(lp.shape)}")
    if lp.shape[-1] == 0:
        raise ValueError("top_logprobs: K (last dim) must be >= 1")
    check_same_device({"top_logprobs": lp, "top_ids": ids})
    lp = check_float(lp, "top_logprobs")
    ids = check_integer_dtype(ids, "top_ids")
    if validate and can_read(lp):
        check_log_values(lp, "top_logprobs", empty_rows=True)
        check_sorted_desc(lp, "top_logprobs")
        check_id_range(ids, "top_ids", vocab_size)
    return lp.contiguous(), ids.contiguous()
