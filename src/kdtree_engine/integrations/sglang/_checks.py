"""Argument checks shared by the drop-in's functions: each raises a ValueError naming the argument."""

from __future__ import annotations

import inspect

import torch

from kdtree_engine.ref.tree import MAX_BUDGET


def need(cond: bool, name: str, what: str) -> None:
    """ValueError "name: what" unless cond holds."""
    if not cond:
        raise ValueError(f"{name}: {what}")


def check_covers(x: torch.Tensor, name: str, least: tuple[int, ...]) -> None:
    """ValueError unless every dim of x is at least `least`'s (a caller's buffer may be larger)."""
    big_enough = all(have >= want for have, want in zip(x.shape, least))
    need(big_enough, name, f"expected at least {least}, got {tuple(x.shape)}")


def check_budget(tree_budget) -> None:
    """The port's tree_budget: an int in [0, MAX_BUDGET], the most nodes our tree ops build."""
    ok = isinstance(tree_budget, int) and not isinstance(tree_budget, bool) and 0 <= tree_budget <= MAX_BUDGET
    need(ok, "tree_budget", f"expected an int in [0, {MAX_BUDGET}], got {tree_budget!r}")


def check_params(owner, want: dict[str, list[str]], where: str) -> None:
    """ValueError naming `where` and every member of owner (a class or module) that is missing or whose
    leading parameters are not `want`'s: the port moved on from the revision we checked against."""
    problems = []
    for name, params in want.items():
        fn = getattr(owner, name, None)
        if not callable(fn):
            problems.append(f"{name} is missing")
            continue
        have = list(inspect.signature(fn).parameters)[: len(params)]
        if have != params:
            problems.append(f"{name} takes {have}, expected {params}")
    need(not problems, where, "not the SGLang DDTree port this was checked against: " + "; ".join(problems))
