"""Triton tree ops, the `impl="triton"` side of kdtree_engine.tree.ops. Inputs arrive validated and
contiguous; every op is a fixed sequence of launches with no host synchronisation, so a batch and
budget can be captured in a CUDA graph."""

from __future__ import annotations

import torch

from kdtree_engine.kernels.tree_accept import accept_greedy
from kdtree_engine.kernels.tree_build import build_tree
from kdtree_engine.kernels.tree_compile import compile_tree
from kdtree_engine.kernels.tree_sample import sample_tokens
from kdtree_engine.kernels.tree_topk import logits_topk
from kdtree_engine.tree_types import DraftTree

__all__ = [
    "accept_greedy",
    "build_tree",
    "build_tree_from_logits",
    "compile_tree",
    "logits_topk",
    "sample_tokens",
]


def build_tree_from_logits(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """draft_logits [B, L, V] float (validated) -> DraftTree: top-k (k = min(budget, V)) with the
    log-softmax normalizer, then the best-first build; equal to the reference."""
    b, depth, vocab = draft_logits.shape
    if budget == 0 or b * depth == 0:
        lp = torch.zeros((b, depth, 1), dtype=torch.float32, device=draft_logits.device)
        return build_tree(lp, lp.long(), budget)
    lp, ids = logits_topk(draft_logits, min(budget, vocab))
    return build_tree(lp, ids, budget)
