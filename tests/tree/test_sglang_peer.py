"""The SGLang peer adapter of `kdtree-engine bench tree` (bench/peers.load_sglang).

On CPU CI: a stand-in `ddtree_utils.py` written here, with SGLang's call convention (a batch of
draft logits [B, L, V], the budget and a device in; padded [B, budget] tokens and depths and
[B, budget + 1] parents, -1 past the tree, out) and our own reference inside; the adapter must find
it in an SGLang-shaped checkout, cut the padding and give back our trees, and the benchmark must run
with it. With a real checkout:
KDTREE_SGLANG_DDTREE=/path/to/sglang pytest tests/tree/test_sglang_peer.py (its trees against ours).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kdtree_engine.bench import peers
from kdtree_engine.tree import build_tree_from_logits

STAND_IN = """
import torch
from kdtree_engine.tree import build_tree_from_logits


def build_ddtree_tree(draft_logits, tree_budget, device):
    bs = draft_logits.shape[0]
    tree = build_tree_from_logits(draft_logits.float().cpu(), tree_budget, impl="ref")
    tokens = torch.zeros(bs, tree_budget, dtype=torch.long)
    depths = torch.zeros(bs, tree_budget, dtype=torch.long)
    parents = torch.full((bs, tree_budget + 1), -1, dtype=torch.long)
    for b in range(bs):
        n = int(tree.num_nodes[b])
        tokens[b, :n], depths[b, :n] = tree.tokens[b, :n], tree.depths[b, :n]
        parents[b, : n + 1] = tree.parents[b, : n + 1]
    return tokens.to(device), depths.to(device), parents.to(device), [{}] * bs, None
"""


def checkout(root, text=STAND_IN):
    folder = root / "python" / "sglang" / "srt" / "speculative"
    folder.mkdir(parents=True)
    (folder / "ddtree_utils.py").write_text(text)
    return root


def test_adapter_cuts_padding_and_returns_trees(tmp_path):
    build = peers.load_sglang(checkout(tmp_path))
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    logits[1] = 0.0  # every logit ties: the pinned tie order decides the tree
    for budget in (0, 1, 7, 20):
        want = build_tree_from_logits(logits, budget, impl="ref")
        trees = build(logits, budget)
        assert len(trees) == 3
        for r, (tokens, depths, parents) in enumerate(trees):
            n = int(want.num_nodes[r])
            assert tokens.tolist() == want.tokens[r, :n].tolist()
            assert depths.tolist() == want.depths[r, :n].tolist()
            assert parents == want.parents[r, : n + 1].tolist()


def test_bench_tree_runs_the_sglang_peer(tmp_path):
    from kdtree_engine.cli import main

    root = checkout(tmp_path / "sglang")
    argv = ["bench", "tree", "--batch", "2", "--depth", "2", "--budgets", "3", "--vocab", "40"]
    argv += ["--out", str(tmp_path / "out"), "--host-iters", "1", "--rep-ms", "5", "--graph-calls", "1"]
    assert main([*argv, "--peer", f"sglang={root}"]) == 0
    row = json.loads((tmp_path / "out" / "tree_bench.json").read_text())["rows"][0]
    assert row["sglang same tree"] and row["sglang"] > 0
    device = "gpu" if torch.cuda.is_available() else "cpu"  # bench tree labels figures by the device
    assert f"sglang / {device} topk->tree" in (tmp_path / "out" / "tree_bench.md").read_text()


def test_bad_peers_are_value_errors(tmp_path):
    from kdtree_engine.bench.tree import _load_peers

    with pytest.raises(ValueError, match="^path:"):
        peers.load_sglang(tmp_path)  # no ddtree_utils.py
    with pytest.raises(ValueError, match="^path:.*build_ddtree_tree"):
        peers.load_sglang(checkout(tmp_path / "a", "X = 1\n"))
    with pytest.raises(ValueError, match="^path:.*not_a_module"):
        peers.load_sglang(checkout(tmp_path / "b", "import not_a_module\n"))
    for spec in ("sglang", "vllm=/x", "official="):
        with pytest.raises(ValueError, match="^--peer:"):
            _load_peers([spec])


REAL = os.environ.get("KDTREE_SGLANG_DDTREE")


@pytest.mark.skipif(not REAL, reason="set KDTREE_SGLANG_DDTREE to an SGLang checkout with the DDTree builder")
def test_real_sglang_builder_equals_ours(monkeypatch):
    """With its torch.logsumexp replaced by our normalizer, as in test_official.py."""
    from tests.tree.test_official import our_logsumexp

    build = peers.load_sglang(REAL)
    monkeypatch.setattr(torch, "logsumexp", our_logsumexp)
    for seed in range(200):
        rnd = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        b, depth, vocab = rnd.choice([1, 3]), rnd.choice([1, 2, 5, 15]), rnd.choice([2, 17, 300])
        budget = rnd.choice([1, 2, 7, 8, 16, 32, 63])
        logits = (torch.randn(b, depth, vocab, generator=g) * rnd.choice([0.5, 2.0])).bfloat16()
        want = build_tree_from_logits(logits, budget, impl="ref")
        for r, (tokens, _depths, parents) in enumerate(build(logits, budget)):
            n = int(want.num_nodes[r])
            assert tokens.tolist() == want.tokens[r, :n].tolist(), seed
            assert parents == want.parents[r, : n + 1].tolist(), seed
