"""Masked tokens (-inf logits) in the reference builder (hypothesis): they never enter a tree, the tree
holds min(budget, finite paths) nodes, and it is the start of the tree in which every masked logit is
instead finite and far below the rest (dropped == kept last, while finite paths remain)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdtree_engine.tree import build_tree_from_logits

FAR_BELOW = -1e6  # every path through such a logit scores below every finite path of these logits

cases = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 3),  # B
    st.integers(1, 6),  # L
    st.integers(1, 12),  # V
    st.integers(0, 40),  # budget
    st.sampled_from([0.0, 0.3, 0.7, 0.95]),  # share of masked logits
    st.booleans(),  # coarse (ties among the finite logits)
)


def masked_logits(seed: int, b: int, depth: int, vocab: int, share: float, coarse: bool):
    """(logits with -inf at the mask, the mask [b, depth, vocab] bool); every row keeps a finite logit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, depth, vocab, generator=g) * 2
    if coarse:
        x = torch.round(x)
    mask = torch.rand(b, depth, vocab, generator=g) < share
    keep = torch.randint(0, vocab, (b, depth, 1), generator=g)
    mask.scatter_(-1, keep, False)
    return x.masked_fill(mask, float("-inf")), mask


def finite_paths(mask: torch.Tensor, r: int, k: int) -> int:
    """Root-to-node paths of request r through unmasked top-k entries only."""
    per_depth = [min(k, int((~row).sum())) for row in mask[r]]
    return sum(math.prod(per_depth[: d + 1]) for d in range(len(per_depth)))


@settings(max_examples=200, deadline=None)
@given(cases)
def test_masked_tokens_never_enter_the_tree(case):
    seed, b, depth, vocab, budget, share, coarse = case
    x, mask = masked_logits(seed, b, depth, vocab, share, coarse)
    tree = build_tree_from_logits(x, budget, impl="ref")
    kept = build_tree_from_logits(x.masked_fill(mask, FAR_BELOW), budget, impl="ref")
    for r in range(b):
        n = int(tree.num_nodes[r])
        assert n == min(budget, finite_paths(mask, r, min(budget, vocab)))
        for i in range(n):
            assert not mask[r, int(tree.depths[r, i]) - 1, int(tree.tokens[r, i])]
        assert tree.tokens[r, :n].tolist() == kept.tokens[r, :n].tolist()
        assert tree.depths[r, :n].tolist() == kept.depths[r, :n].tolist()
        assert tree.parents[r, : n + 1].tolist() == kept.parents[r, : n + 1].tolist()
        assert all(t == -1 for t in tree.tokens[r, n:].tolist())
