"""Triton compile_tree and accept_greedy against the reference on trees from the exact builder."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine import tree as T
from kdtree_engine.ref import tree as ref


def make_tree(seed: int, b: int, depth: int, budget: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(b, depth, 12, generator=g) * 2).bfloat16().float()
    lp, ids = ref.logits_to_topk(x, max(1, min(budget, 12)))
    return ref.build_tree(lp, ids, budget), g


def path_targets(tree, g: torch.Generator) -> torch.Tensor:
    """Targets [B, N] that follow the path to a random node (then a random token), so accepts are long."""
    b, n = tree.batch_size, tree.budget + 1
    target = torch.randint(0, 12, (b, n), generator=g)
    for r in range(b):
        used = int(tree.num_nodes[r]) + 1
        node = int(torch.randint(0, used, (1,), generator=g))
        while node > 0:
            parent = int(tree.parents[r, node])
            target[r, parent] = tree.tokens[r, node - 1]
            node = parent
    return target


def to(tree, device):
    return T.DraftTree(
        *(getattr(tree, f).to(device) for f in ("tokens", "depths", "parents", "num_nodes")), tree.max_depth
    )


CASES = [(1, 1, 1), (3, 8, 7), (3, 15, 16), (2, 16, 63), (2, 4, 64), (2, 6, 100), (3, 3, 0), (64, 2, 8)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_compile_and_accept_match_reference(case, device):
    b, depth, budget = case
    tree, g = make_tree(sum(case), b, depth, budget)
    roots, starts = torch.randint(0, 99, (b,), generator=g), torch.randint(0, 500, (b,), generator=g)
    got = T.compile_tree(to(tree, device), roots.to(device), starts.to(device), impl="triton")
    want = ref.compile_tree(tree, roots, starts)
    for f in want.__dataclass_fields__:
        a, w = getattr(got, f), getattr(want, f)
        assert (a is None) == (w is None), f
        assert a is None or torch.equal(a.cpu(), w), f
    for target in (path_targets(tree, g), torch.randint(0, 12, (b, budget + 1), generator=g)):
        got_acc = T.accept_greedy(to(tree, device), target.to(device), impl="triton")
        want_acc = ref.accept_greedy(tree, target)
        for f in ("accepted", "accept_len", "bonus"):
            assert torch.equal(getattr(got_acc, f).cpu(), getattr(want_acc, f)), f


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 3, 64])
@pytest.mark.parametrize("depth", [1, 8, 15, 16])
def test_compile_accept_sweep_gpu(b, depth):
    for budget in (0, 1, 7, 8, 16, 32, 63, 64, 100):
        test_compile_and_accept_match_reference((b, depth, budget), torch.device("cuda"))


def check_masked_trees(seed: int, device) -> None:
    """Trees from masked logits (-inf: they stop short of the budget), compiled and accepted through the
    kernels with the token checks on (vocab_size given): equal to the reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(3, 5, 12, generator=g) * 2)
    mask = torch.rand(3, 5, 12, generator=g) < 0.8
    mask[..., seed % 12] = False
    tree = ref.build_tree(*ref.logits_to_topk(x.masked_fill(mask, float("-inf")), 12), 40)
    roots, starts = torch.randint(0, 12, (3,), generator=g), torch.randint(0, 500, (3,), generator=g)
    got = T.compile_tree(to(tree, device), roots.to(device), starts.to(device), vocab_size=12, impl="triton")
    want = ref.compile_tree(tree, roots, starts)
    for f in want.__dataclass_fields__:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    target = path_targets(tree, g)
    got_acc = T.accept_greedy(to(tree, device), target.to(device), vocab_size=12, impl="triton")
    want_acc = ref.accept_greedy(tree, target)
    for f in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(got_acc, f).cpu(), getattr(want_acc, f)), f


@pytest.mark.parametrize("seed", range(3))
def test_compile_and_accept_masked_trees(seed, device):
    check_masked_trees(seed, device)


@pytest.mark.gpu
def test_compile_and_accept_masked_trees_gpu():
    for seed in range(50):
        check_masked_trees(seed, torch.device("cuda"))
