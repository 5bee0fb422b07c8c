"""Hand-worked trees: the rank-path tie-break, and the official example shapes."""

import torch

from kdtree_engine.tree import accept_greedy, build_tree


def test_rank_path_tie_break_differs_from_insertion_order():
    # All log-probs equal: after (0,), (1,), (0,0) the candidates (1,0) [pushed first] and (0,1)
    # [pushed later] tie; the rank path (0,1) < (1,0) must win. Insertion order would take (1,0).
    lp = torch.full((1, 2, 2), -1.0)
    ids = torch.tensor([[[10, 11], [20, 21]]])
    tree = build_tree(lp, ids, 4, impl="ref")
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1]
    assert tree.tokens[0].tolist() == [10, 11, 20, 21]
    assert tree.depths[0].tolist() == [1, 1, 2, 2]


def test_chain_star_and_padding():
    ids = torch.arange(12).reshape(1, 3, 4)
    chain = torch.tensor([[[-0.01, -5, -6, -7]] * 3])
    tree = build_tree(chain, ids, 3, impl="ref")
    assert tree.parents[0].tolist() == [-1, 0, 1, 2]
    star = torch.tensor([[[-0.1, -0.2, -0.3, -0.4], [-9.0, -9.5, -9.6, -9.7], [-9.0, -9.5, -9.6, -9.7]]])
    tree = build_tree(star, ids, 4, impl="ref")
    assert tree.parents[0].tolist() == [-1, 0, 0, 0, 0]
    # L=1, K=2: only two paths exist, so a budget of 5 leaves three padded slots.
    tree = build_tree(torch.tensor([[[-0.5, -1.0]]]), torch.tensor([[[3, 4]]]), 5, impl="ref")
    assert int(tree.num_nodes[0]) == 2
    assert tree.tokens[0].tolist() == [3, 4, -1, -1, -1]
    assert tree.parents[0].tolist() == [-1, 0, 0, -1, -1, -1]


def test_budget_zero_is_root_only():
    tree = build_tree(torch.full((2, 3, 4), -1.0), torch.zeros(2, 3, 4, dtype=torch.long), 0, impl="ref")
    assert tree.tokens.shape == (2, 0) and tree.parents.tolist() == [[-1], [-1]]
    res = accept_greedy(tree, torch.tensor([[7], [8]]), impl="ref")
    assert res.accept_len.tolist() == [1, 1] and res.bonus.tolist() == [7, 8]
    assert res.accepted.tolist() == [[0, -1, -1, -1], [0, -1, -1, -1]]


def test_kernel_walk_equals_ref_on_tied_trees_shallower_and_deeper_than_their_budget():
    """The shared greedy-walk kernel (Triton, the interpreter on the CPU) against the reference on
    trees with tied log-probs and repeated tokens, budgets from 0 up, so that the accepted path's width
    L + 1 is sometimes larger than the node count N (budget 0 to 3 at depth up to 8)."""
    import pytest

    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    for _ in range(40):
        depth = int(torch.randint(1, 9, (), generator=gen))
        vocab = int(torch.randint(2, 5, (), generator=gen))
        budget = int(torch.randint(0, 10, (), generator=gen))
        lp = (
            torch.randint(-2, 1, (3, depth, vocab), generator=gen)
            .float()
            .sort(dim=-1, descending=True)
            .values
        )
        ids = torch.randint(0, 3, (3, depth, vocab), generator=gen)  # repeated tokens: sibling ties
        tree = build_tree(lp, ids, budget, impl="ref")
        target = torch.randint(0, 3, (3, budget + 1), generator=gen)
        want, got = (accept_greedy(tree, target, impl=impl) for impl in ("ref", "triton"))
        for field in ("accepted", "accept_len", "bonus"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, budget, depth)
