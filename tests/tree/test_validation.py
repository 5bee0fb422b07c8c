"""Bad input at the public boundary gives a ValueError naming the argument."""

import numpy as np
import pytest
import torch

from kdtree_engine.tree import accept_greedy, build_tree, build_tree_from_logits, compile_tree


def good(b=2, depth=3, k=4):
    lp = torch.sort(torch.randn(b, depth, k), dim=-1, descending=True).values
    return lp, torch.arange(b * depth * k).reshape(b, depth, k)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda lp, ids: (lp[0, 0], ids), "top_logprobs"),  # rank 1
        (lambda lp, ids: (lp, ids[:, :, :2]), "top_ids"),  # shape mismatch
        (lambda lp, ids: (lp.long(), ids), "top_logprobs"),  # not float
        (lambda lp, ids: (lp, ids.float()), "top_ids"),  # not int
        (lambda lp, ids: (lp.index_fill(2, torch.tensor([1]), float("nan")), ids), "top_logprobs"),
        (lambda lp, ids: (lp.index_fill(2, torch.tensor([0]), float("inf")), ids), "top_logprobs"),
        (lambda lp, ids: (lp.flip(-1), ids), "top_logprobs"),  # ascending rows
        (lambda lp, ids: (lp, ids - 5), "top_ids"),  # negative ids
        (lambda lp, ids: (lp[:, :, :0], ids[:, :, :0]), "top_logprobs"),  # K = 0
        (lambda lp, ids: ([[1.0]], ids), "top_logprobs"),  # not a tensor
    ],
)
def test_build_tree_rejects(mutate, match):
    lp, ids = mutate(*good())
    with pytest.raises(ValueError, match=match):
        build_tree(lp, ids, 4)


def test_build_tree_rejects_budget_and_vocab():
    lp, ids = good()
    for budget in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="budget"):
            build_tree(lp, ids, budget)
    with pytest.raises(ValueError, match="top_ids"):
        build_tree(lp, ids, 4, vocab_size=10)


def test_build_tree_rejects_mixed_devices():
    lp, ids = good()
    meta_ids = ids.to("meta")
    with pytest.raises(ValueError, match="device"):
        build_tree(lp, meta_ids, 4)


def test_numpy_and_rank2_inputs_are_accepted():
    lp, ids = good(b=1)
    a = build_tree(lp.numpy(), ids.numpy(), 5)
    b = build_tree(lp[0], ids[0], 5)
    assert torch.equal(a.parents, b.parents) and torch.equal(a.tokens, b.tokens)
    assert isinstance(np.asarray(a.tokens), np.ndarray)


def test_build_from_logits_rejects():
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.randn(2, 3, 4, 5), 4)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.tensor([[[1.0, float("nan")]]]), 4)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.randint(0, 3, (1, 2, 3)), 4)
    with pytest.raises(ValueError, match="budget"):
        build_tree_from_logits(torch.randn(1, 2, 3), -2)
    with pytest.raises(ValueError, match="impl"):
        build_tree_from_logits(torch.randn(1, 2, 3), 2, impl="cuda")
    with pytest.raises(ValueError, match="draft_logits"):  # V above 2^22: the normalizer's int64 sum
        build_tree_from_logits(torch.zeros(1, 1, 2**22 + 1, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.zeros(1, 1, 0), 2)


def test_compile_and_accept_reject():
    lp, ids = good()
    tree = build_tree(lp, ids, 5)
    roots, starts = torch.tensor([1, 2]), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="tree"):
        compile_tree("tree", roots, starts)
    with pytest.raises(ValueError, match="root_tokens"):
        compile_tree(tree, torch.tensor([1]), starts)
    with pytest.raises(ValueError, match="start_positions"):
        compile_tree(tree, roots, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="start_positions"):
        compile_tree(tree, roots, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="target_tokens"):
        accept_greedy(tree, torch.zeros(2, 5, dtype=torch.long))  # needs N = 6 columns
    with pytest.raises(ValueError, match="target_tokens"):
        accept_greedy(tree, torch.zeros(2, 6))
