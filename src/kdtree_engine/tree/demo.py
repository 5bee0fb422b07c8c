"""`kdtree-engine tree --demo`: build a tree from random drafter logits, compile it, accept, and print."""

from __future__ import annotations

import argparse

import torch

from kdtree_engine.impl import IMPLS
from kdtree_engine.tree import accept_greedy, build_tree_from_logits, compile_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--demo", action="store_true", help="run on random logits (the default)")
    parser.add_argument("--depth", type=int, default=4, help="draft block length L")
    parser.add_argument("--vocab", type=int, default=12, help="vocabulary size V")
    parser.add_argument("--budget", type=int, default=8, help="tree nodes, root not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--impl", choices=IMPLS, default=None, help="default: the fastest that applies")


def render(tree, b: int = 0) -> list[str]:
    """One line per node, indented by depth: `[index] token`."""
    n = int(tree.num_nodes[b])
    children: dict[int, list[int]] = {}
    for i in range(1, n + 1):
        children.setdefault(int(tree.parents[b, i]), []).append(i)
    lines = []

    def visit(i: int, depth: int) -> None:
        label = "root" if i == 0 else f"token {int(tree.tokens[b, i - 1])}"
        lines.append(f"{'  ' * depth}[{i}] {label}")
        for c in children.get(i, []):
            visit(c, depth + 1)

    visit(0, 0)
    return lines


def main(args: argparse.Namespace) -> int:
    for name in ("depth", "vocab"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected >= 1")
    g = torch.Generator().manual_seed(args.seed)
    logits = torch.randn(1, args.depth, args.vocab, generator=g) * 2
    tree = build_tree_from_logits(logits, args.budget, impl=args.impl)
    print(f"DDTree: L={args.depth} V={args.vocab} budget={args.budget}, {int(tree.num_nodes[0])} nodes")
    print("\n".join(render(tree)))
    verify = compile_tree(tree, torch.tensor([0]), torch.tensor([100]), impl=args.impl)
    print("positions:", verify.positions[0].tolist())
    print("visibility (row i: nodes that node i attends to):")
    for i, row in enumerate(verify.visibility[0].int().tolist()):
        print(f"  {i:3d} " + "".join("#" if x else "." for x in row))
    # Pretend the target agrees with the drafter's greedy chain: the walk accepts it.
    target = torch.zeros((1, tree.budget + 1), dtype=torch.long)
    target[0, 0] = logits[0, 0].argmax()
    for i in range(1, int(tree.num_nodes[0]) + 1):
        d = int(tree.depths[0, i - 1])
        target[0, i] = logits[0, d].argmax() if d < args.depth else 0
    result = accept_greedy(tree, target, impl=args.impl)
    n = int(result.accept_len[0])
    print(
        f"accept (target = drafter argmax): nodes {result.accepted[0, :n].tolist()}, "
        f"bonus {int(result.bonus[0])}"
    )
    return 0
