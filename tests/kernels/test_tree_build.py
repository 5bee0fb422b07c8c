"""Triton best-first build (kernels/tree_build.py) against the exact reference, ties included.

CPU CI runs a representative subset through the Triton interpreter; the full sweep of the issue
(B in {1, 3, 64}, L in {1, 8, 15, 16}, budgets {0, 1, 7, 8, 16, 32, 63, 64, 100}, smooth and
bf16-tied inputs) is marked gpu. Every case draws fresh inputs from its own seed.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kdtree_engine import tree as T
from kdtree_engine.kernels.tree_topk import logits_topk
from kdtree_engine.ref import tree as ref

FIELDS = ("tokens", "depths", "parents", "num_nodes")


def make_topk(seed: int, b: int, depth: int, k: int, kind: str, vocab: int = 1000):
    """Sorted log-probs [b, depth, k] float32 and distinct ids. kind: smooth | bf16 (ties) | flat |
    masked (-inf tails: most logits masked, some rows wholly -inf, request 0's first row among them
    when b > 1, which gives it an empty tree)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, depth, vocab, generator=g) * 2
    if kind in ("bf16", "masked"):
        x = (torch.round(x * 2) / 2).bfloat16().float()
    if kind == "flat":
        x = torch.zeros_like(x)
    if kind == "masked":
        mask = torch.rand(b, depth, vocab, generator=g) < 0.995
        mask.scatter_(-1, torch.randint(0, vocab, (b, depth, 1), generator=g), False)
        x = x.masked_fill(mask, float("-inf"))
    lp, ids = ref.logits_to_topk(x, min(k, vocab))
    if kind == "masked":
        lp[torch.rand(b, depth, generator=g) < 0.2] = float("-inf")
        lp[0, 0] = float("-inf") if b > 1 else lp[0, 0]
    return lp, ids


def assert_same_tree(got, want) -> None:
    assert got.max_depth == want.max_depth
    for f in FIELDS:
        a, b = getattr(got, f).cpu(), getattr(want, f)
        assert torch.equal(a, b), f"{f}: first mismatch at {(a != b).nonzero()[:1].tolist()}"


def check(seed, b, depth, k, budget, kind, device):
    lp, ids = make_topk(seed, b, depth, k, kind)
    got = T.build_tree(lp.to(device), ids.to(device), budget, impl="triton")
    assert got.tokens.device.type == device.type
    assert_same_tree(got, ref.build_tree(lp, ids, budget))


CPU_CASES = [  # (b, depth, k, budget, kind)
    (1, 1, 4, 1, "smooth"),
    (3, 8, 16, 7, "bf16"),
    (3, 15, 8, 16, "bf16"),
    (2, 16, 64, 63, "bf16"),
    (1, 16, 64, 64, "smooth"),
    (2, 4, 4, 100, "bf16"),
    (2, 5, 6, 30, "flat"),
    (64, 2, 3, 8, "bf16"),
    (3, 1, 2, 5, "smooth"),  # heap runs dry: only 2 paths exist
    (3, 6, 16, 16, "masked"),  # -inf tails and wholly masked rows: the tree stops short
    (2, 4, 8, 40, "masked"),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_build_matches_reference(case, device):
    check(sum(case[:4]), *case, device)


def test_masked_entries_never_enter_the_tree(device):
    """The kernel drops -inf entries as the reference does: no node has a -inf log-prob, a masked
    first row gives an empty tree, and each tree holds min(budget, paths through finite entries)."""
    lp, ids = make_topk(5, 3, 6, 16, "masked")
    got = T.build_tree(lp.to(device), ids.to(device), 40, impl="triton")
    assert_same_tree(got, ref.build_tree(lp, ids, 40))
    for r in range(3):
        per_depth = (lp[r] > float("-inf")).sum(-1).tolist()
        paths = sum(math.prod(per_depth[: d + 1]) for d in range(len(per_depth)))
        assert int(got.num_nodes[r]) == min(40, paths)
    assert got.num_nodes.tolist()[0] == 0 and min(got.num_nodes.tolist()[1:]) < 40
    for r in range(3):
        for i in range(int(got.num_nodes[r])):
            col = (ids[r, int(got.depths[r, i]) - 1] == got.tokens[r, i].cpu()).nonzero()[0]
            assert lp[r, int(got.depths[r, i]) - 1, col] > float("-inf")


def test_budget_zero_and_empty_batch(device):
    lp, ids = make_topk(1, 2, 3, 4, "smooth")
    assert_same_tree(
        T.build_tree(lp.to(device), ids.to(device), 0, impl="triton"), ref.build_tree(lp, ids, 0)
    )
    empty = T.build_tree(lp[:0].to(device), ids[:0].to(device), 5, impl="triton")
    assert empty.tokens.shape == (0, 5) and empty.parents.shape == (0, 6)


def test_budget_above_kernel_limit_is_a_value_error(device):
    lp, ids = make_topk(2, 1, 2, 4, "smooth")
    with pytest.raises(ValueError, match="budget"):
        T.build_tree(lp.to(device), ids.to(device), 5000, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 3, 64])
@pytest.mark.parametrize("depth", [1, 8, 15, 16])
def test_build_full_sweep_gpu(b, depth):
    device = torch.device("cuda")
    kinds = ["smooth", "bf16", "flat", "masked"]
    for budget, kind in itertools.product([0, 1, 7, 8, 16, 32, 63, 64, 100, 256], kinds):
        check(1000 * b + 10 * depth + budget, b, depth, max(budget, 1), budget, kind, device)


@pytest.mark.gpu
def test_step_is_cuda_graph_capturable():
    """Logits -> tree -> compile -> accept captured once, replayed on fresh inputs, equals the reference."""
    cuda, b, depth, vocab, budget = torch.device("cuda"), 8, 15, 163840, 32
    logits = torch.zeros(b, depth, vocab, dtype=torch.bfloat16, device=cuda)
    roots = torch.zeros(b, dtype=torch.int64, device=cuda)
    starts = torch.full((b,), 7, dtype=torch.int64, device=cuda)
    target = torch.zeros(b, budget + 1, dtype=torch.int64, device=cuda)

    def step():
        tree = T.build_tree_from_logits(logits, budget, validate=False)
        return tree, T.compile_tree(tree, roots, starts), T.accept_greedy(tree, target)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree, verify, acc = step()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        fresh = (torch.randn(b, depth, vocab, generator=g) * 2).bfloat16()
        logits.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        lp, ids = logits_topk(fresh.to(cuda), budget)  # the build is checked on the kernel's own top-k
        want = ref.build_tree(lp.cpu(), ids.cpu(), budget)
        assert_same_tree(tree, want)
        want_verify = ref.compile_tree(want, roots.cpu(), starts.cpu())
        assert torch.equal(verify.visibility.cpu(), want_verify.visibility)
        assert torch.equal(acc.accept_len.cpu(), ref.accept_greedy(want, target.cpu()).accept_len)
