"""Fused weights without a second copy: parameters that one GEMM reads together (a layer's q/k/v, the
projections that read the same input) are packed into one buffer and each parameter becomes a view of
its rows. Names, shapes, Parameter objects, loading and in-place updates are unchanged; anything that
replaces a parameter's storage (`.to(dtype)`, `.cuda()`) breaks the views, which `intact` notices so the
caller packs again. Used by the target's MLA layer and the DFlash drafter."""

from __future__ import annotations

import torch
from torch import nn

Pointers = tuple[tuple[nn.Parameter, int], ...]


@torch.no_grad()
def pack_rows(groups: list[list[nn.Parameter]], ptrs: list) -> torch.Tensor:
    """groups[g]: parameters of one shape apart from the first dim, concatenated along it -> one buffer
    [len(groups), sum of the first dims, ...] (groups of equal layout, e.g. one per layer); each parameter
    becomes a view of its rows, and (parameter, data_ptr) is appended to ptrs for `intact`."""
    first = groups[0][0]
    rows = sum(p.shape[0] for p in groups[0])
    buf = first.new_empty((len(groups), rows, *first.shape[1:]))  # one copy at a time: no second buffer
    for index, group in enumerate(groups):
        row = 0
        for p in group:
            view = buf[index, row : row + p.shape[0]]
            view.copy_(p.detach())
            p.data = view
            ptrs.append((p, p.data_ptr()))
            row += p.shape[0]
    return buf


def intact(ptrs: Pointers) -> bool:
    """Whether every packed parameter still points where pack_rows put it."""
    return all(p.data_ptr() == ptr for p, ptr in ptrs)
