"""Property tests of the reference tree ops on random inputs (hypothesis)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdtree_engine.tree import accept_greedy, build_tree, compile_tree
from tests.tree.helpers import ancestors_or_self, path_score, random_topk, rank_paths

cases = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 3),  # B
    st.integers(1, 6),  # L
    st.integers(1, 12),  # V
    st.integers(0, 40),  # budget
    st.booleans(),  # coarse (ties)
)


def build(case):
    seed, b, depth, vocab, budget, coarse = case
    lp, ids = random_topk(seed, b, depth, vocab, max(1, min(budget, vocab)), coarse)
    return lp, ids, budget, build_tree(lp, ids, budget, impl="ref")


@settings(max_examples=150, deadline=None)
@given(cases)
def test_structure(case):
    lp, ids, budget, tree = build(case)
    depth_limit, k = lp.shape[1], lp.shape[2]
    paths_available = sum(k**d for d in range(1, depth_limit + 1)) if budget else 0
    for r in range(tree.batch_size):
        n = int(tree.num_nodes[r])
        assert n == min(budget, paths_available)  # budget respected, never short while paths remain
        parents = tree.parents[r].tolist()
        assert parents[0] == -1 and all(p == -1 for p in parents[n + 1 :])
        assert all(t == -1 for t in tree.tokens[r, n:].tolist())
        for i in range(1, n + 1):
            p = parents[i]
            assert 0 <= p < i  # parents come before children
            parent_depth = 0 if p == 0 else int(tree.depths[r, p - 1])
            assert int(tree.depths[r, i - 1]) == parent_depth + 1
            assert int(tree.tokens[r, i - 1]) in ids[r, parent_depth].tolist()
        paths = rank_paths(tree, ids, r)
        assert len(set(paths)) == len(paths)  # no path twice
        assert all(path[:-1] in set(paths) for path in paths[1:])  # prefix-closed


@settings(max_examples=150, deadline=None)
@given(cases)
def test_best_first_optimal_and_tie_order(case):
    lp, ids, budget, tree = build(case)
    depth_limit, k = lp.shape[1], min(budget, lp.shape[2])
    for r in range(tree.batch_size):
        lpr = lp[r].double().numpy()
        paths = rank_paths(tree, ids, r)[1:]
        scores = [path_score(lpr, p) for p in paths]
        # Pop order is best-first; equal scores come in rank-path order.
        for (s0, p0), (s1, p1) in zip(zip(scores, paths), zip(scores[1:], paths[1:])):
            assert s1 <= s0 + 1e-9
            if abs(s1 - s0) < 1e-12:
                assert p0 < p1
        # No excluded path scores above an included one: the frontier (next sibling or first child of
        # an included node, not itself included) bounds every excluded path as log-probs are <= 0.
        included = set(paths)
        frontier = [p[:-1] + (p[-1] + 1,) for p in paths if p[-1] + 1 < k]
        frontier += [p + (0,) for p in paths if len(p) < depth_limit]
        if not paths and budget > 0:
            frontier = [(0,)]
        worst_in = min(scores, default=np.inf)
        for p in frontier:
            if p not in included:
                assert path_score(lpr, p) <= worst_in + 1e-9


@settings(max_examples=100, deadline=None)
@given(cases, st.integers(0, 2**31 - 1))
def test_compile_and_accept(case, seed):
    lp, ids, budget, tree = build(case)
    b, n = tree.batch_size, budget + 1
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, 50, (b,), generator=g)
    starts = torch.randint(0, 1000, (b,), generator=g)
    v = compile_tree(tree, roots, starts, impl="ref")
    # Targets: mostly a child's token, sometimes anything.
    target = torch.randint(0, 20, (b, n), generator=g)
    for r in range(b):
        for i in range(1, int(tree.num_nodes[r]) + 1):
            if torch.rand((), generator=g) < 0.7:
                target[r, int(tree.parents[r, i])] = tree.tokens[r, i - 1]
    res = accept_greedy(tree, target, impl="ref")
    for r in range(b):
        used = int(tree.num_nodes[r]) + 1
        parents = tree.parents[r].tolist()
        assert v.input_ids[r, 0] == roots[r] and v.positions[r, 0] == starts[r]
        for i in range(n):
            expect = ancestors_or_self(parents, i) if i < used else {i}
            assert set(torch.nonzero(v.visibility[r, i]).flatten().tolist()) == expect
            if v.ancestor_bits is not None:
                assert int(v.ancestor_bits[r, i]) == sum(1 << j for j in expect) - (
                    1 << 64 if 63 in expect else 0
                )
            if 0 < i < used:
                assert v.positions[r, i] == starts[r] + tree.depths[r, i - 1]
                assert v.input_ids[r, i] == tree.tokens[r, i - 1]
        # EAGLE arrays enumerate each node's children in index order.
        for i in range(used):
            children, c = [], int(v.retrieve_next_token[r, i])
            while c != -1:
                children.append(c)
                c = int(v.retrieve_next_sibling[r, c])
            assert children == [j for j in range(1, used) if parents[j] == i]
        # Accept walks only real edges, each step justified by the target, and stops for a reason.
        length = int(res.accept_len[r])
        path = res.accepted[r, :length].tolist()
        assert path[0] == 0 and all(x == -1 for x in res.accepted[r, length:].tolist())
        for a, c in zip(path, path[1:]):
            assert parents[c] == a and int(target[r, a]) == int(tree.tokens[r, c - 1])
        last = path[-1]
        assert int(res.bonus[r]) == int(target[r, last])
        child_tokens = {int(tree.tokens[r, j - 1]) for j in range(1, used) if parents[j] == last}
        assert int(target[r, last]) not in child_tokens
