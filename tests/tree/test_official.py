"""Our reference against the official DDTree builder, when a local checkout is given:
KDTREE_OFFICIAL_DDTREE=/path/to/liranringel/ddtree pytest tests/tree/test_official.py

The official builder normalizes with torch.logsumexp, whose last bit depends on the device and the
summation order; ours is ref.tree.log_normalizer, the same bits everywhere. On exact score ties that bit
can decide the tree, so the official builder runs here with its logsumexp replaced by our normalizer:
what is compared is the top-k order, the heap and its tie-break."""

import os
import random

import pytest
import torch

from kdtree_engine.ref.tree import log_normalizer
from kdtree_engine.tree import build_tree_from_logits

OFFICIAL = os.environ.get("KDTREE_OFFICIAL_DDTREE")
pytestmark = pytest.mark.skipif(not OFFICIAL, reason="set KDTREE_OFFICIAL_DDTREE to a ddtree checkout")
CASES = int(os.environ.get("KDTREE_OFFICIAL_CASES", "2000"))


def draw(seed: int):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    depth = rnd.choice([1, 2, 3, 5, 8, 15, 16])
    vocab = rnd.choice([1, 2, 3, 5, 17, 64, 300])
    budget = rnd.choice([0, 1, 2, 7, 8, 16, 32, 63, 64, 100])
    logits = torch.randn(depth, vocab, generator=g) * rnd.choice([0.5, 2.0, 5.0])
    kind = rnd.choice(["fp32", "bf16", "coarse"])
    if kind == "bf16":
        logits = logits.bfloat16()
    elif kind == "coarse":
        logits = torch.round(logits * 2) / 2  # many exact score ties
    return logits, budget


def our_logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    assert dim in (-1, x.dim() - 1)
    lse = log_normalizer(x.float())
    return lse if keepdim else lse.squeeze(-1)


def test_equals_official_builder(monkeypatch):
    from kdtree_engine.bench.peers import load_official

    official = load_official(OFFICIAL)
    monkeypatch.setattr(torch, "logsumexp", our_logsumexp)  # the peer's torch module looks it up per call
    for seed in range(CASES):
        logits, budget = draw(seed)
        tokens, depths, parents, _ = official(logits, budget)
        tree = build_tree_from_logits(logits, budget, impl="ref")
        n = int(tree.num_nodes[0])
        assert n == tokens.numel(), seed
        assert tree.tokens[0, :n].tolist() == tokens.tolist(), seed
        assert tree.depths[0, :n].tolist() == depths.tolist(), seed
        assert tree.parents[0, : n + 1].tolist() == list(parents), seed
