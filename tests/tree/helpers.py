"""Shared helpers for the tree tests: random inputs and tree facts derived independently of the builder."""

from __future__ import annotations

import numpy as np
import torch


def random_topk(seed: int, b: int, depth: int, vocab: int, k: int, coarse: bool = False):
    """Proper log-probs (log-softmax, so <= 0) and their top-k, ties ordered by smaller id."""
    from kdtree_engine.ref.tree import logits_to_topk

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, depth, vocab, generator=g) * 2
    if coarse:
        logits = (torch.round(logits * 2) / 2).bfloat16().float()
    return logits_to_topk(logits, k)


def rank_paths(tree, top_ids: torch.Tensor, r: int) -> list[tuple[int, ...]]:
    """Rank path of every node of request r (index 0 = root = ()), from the token's column in top_ids."""
    ids = top_ids[r].numpy()
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, int(tree.num_nodes[r]) + 1):
        depth = int(tree.depths[r, i - 1])
        col = int(np.nonzero(ids[depth - 1] == int(tree.tokens[r, i - 1]))[0][0])
        paths.append(paths[int(tree.parents[r, i])] + (col,))
    return paths


def path_score(lp: np.ndarray, path: tuple[int, ...]) -> float:
    return float(sum(float(lp[d, c]) for d, c in enumerate(path)))


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out
