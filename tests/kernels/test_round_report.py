"""The auto budget's round report in one launch (kernels.round_report) against its reference
(ref.round_report.round_report_ref: path_probabilities, round_sums, would_commit) on fresh random drafts:
ties, masked tokens (trees with unused nodes), every bucket of a tree round and the chain's round, the
accepted paths the walk gives. Sums close (the kernel sums a node's ancestors in another order), the
counts and every NaN exactly equal; on CUDA against the CPU reference."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine.budget import auto_buckets, round_report
from kdtree_engine.engine.stages import chain_of
from kdtree_engine.ref.round_report import report_codes, round_report_ref
from kdtree_engine.tree import accept_greedy, build_tree, compile_tree, logits_topk
from kdtree_engine.tree_types import DraftTree


def _on(tree: DraftTree, device) -> DraftTree:
    fields = ("tokens", "depths", "parents", "num_nodes")
    return DraftTree(*(getattr(tree, f).to(device) for f in fields), tree.max_depth)


def _draft(seed: int, b: int, depth: int, vocab: int) -> torch.Tensor:
    """Draft logits with ties (rounded rows) and masked tokens (a row with few finite ones)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, depth, vocab, generator=gen) * 2
    logits[0] = logits[0].round()
    if b > 1:
        logits[1, :, 3:] = float("-inf")
    return logits


def _round(logits: torch.Tensor, n: int, chain: int | None, seed: int):
    """The tensors a round of bucket n reports from: the top-k, the tree, its visibility, and the
    accepted path of a target that follows the tree for a random number of steps."""
    if n == chain:
        lp, ids = logits_topk(logits, 1, impl="ref")
        tree = chain_of(ids[..., 0])
    else:
        lp, ids = logits_topk(logits, n, impl="ref")
        tree = build_tree(lp, ids, n, impl="ref")
    b = logits.shape[0]
    zeros = torch.zeros(b, dtype=torch.int64)
    vis = compile_tree(tree, zeros, zeros, impl="ref").visibility
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, logits.shape[-1], (b, n + 1), generator=gen)
    for r in range(b):  # follow the path to a random node
        node = int(torch.randint(0, int(tree.num_nodes[r]) + 1, (1,), generator=gen))
        while node > 0:
            parent = int(tree.parents[r, node])
            target[r, parent] = tree.tokens[r, node - 1]
            node = parent
    accepted = accept_greedy(tree, target, impl="ref").accepted
    return lp, ids, tree, vis, accepted


CASES = [(15, 3, 80), (7, 3, 11), (15, 1, 200), (3, 5, 9)]  # (L, batch, vocab)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_round_report_kernel_matches_the_reference(case, device):
    depth, b, vocab = case
    buckets = auto_buckets(depth)
    chain = depth if depth in buckets else None
    logits = _draft(sum(case), b, depth, vocab)
    for n in [k for k in buckets if k]:
        lp, ids, tree, vis, accepted = _round(logits, n, chain, seed=n)
        want = round_report_ref(lp, ids, tree, vis, accepted, report_codes(buckets, n, chain, "cpu"))
        on = [t.to(device) for t in (lp, ids, vis, accepted)]
        codes = report_codes(buckets, n, chain, device)
        got = round_report(on[0], on[1], _on(tree, device), on[2], on[3], codes, impl="triton").cpu()
        assert got.dtype == torch.float64 and got.shape == (b, 2 * len(buckets))
        assert torch.equal(got.isnan(), want.isnan()), (n, got, want)
        nb = len(buckets)
        assert torch.equal(got[:, nb:].nan_to_num(-1), want[:, nb:].nan_to_num(-1)), n  # counts: exact
        torch.testing.assert_close(
            got[:, :nb].nan_to_num(-1), want[:, :nb].nan_to_num(-1), rtol=2e-6, atol=1e-6
        )


def test_round_report_codes_follow_the_columns_rules():
    buckets, chain = auto_buckets(15), 15  # (0, 4, 8, 15, 16, 32, 64)
    tree_round = report_codes(buckets, 16, chain, "cpu")
    assert tree_round.sums.tolist() == [0, 4, 8, -2, 16, -1, -1]
    assert tree_round.would.tolist() == [-1, 4, 8, -1, 16, -1, -1]
    chain_round = report_codes(buckets, 15, chain, "cpu")
    assert chain_round.sums.tolist() == [-1, -1, -1, 15, -1, -1, -1]
    assert chain_round.would.tolist() == [-1, -1, -1, 15, -1, -1, -1]
