"""`kdtree-engine tree --demo`: build a tree from random drafter logits, compile it, accept, and print."""

from __future__ import annotations

import argparse
import sys

import torch

from kdtree_engine.impl import IMPLS, kernels_unavailable
from kdtree_engine.ref.tree import MAX_BUDGET, MAX_VOCAB
from kdtree_engine.tree import accept_greedy, build_tree_from_logits, compile_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--demo", action="store_true", help="run on random logits (the default)")
    parser.add_argument("--depth", type=int, default=4, help="draft block length L")
    parser.add_argument("--vocab", type=int, default=12, help="vocabulary size V")
    parser.add_argument("--budget", type=int, default=8, help="tree nodes, root not counted")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random logits")
    parser.add_argument(
        "--impl",
        choices=IMPLS,
        default=None,
        help="ref: the torch reference; triton, hopper: the Triton kernels, on a CUDA GPU (or on the CPU "
        "through the Triton interpreter with TRITON_INTERPRET=1) (default: ref, on the CPU)",
    )


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


def _argument_error(args: argparse.Namespace) -> str | None:
    """The message for a bad argument, or None."""
    for name, minimum in (("depth", 1), ("vocab", 1), ("budget", 0)):
        if getattr(args, name) < minimum:
            return f"--{name}: expected >= {minimum}, got {getattr(args, name)}"
    if args.vocab > MAX_VOCAB:
        return f"--vocab: expected <= {MAX_VOCAB}, got {args.vocab}"
    if args.budget > MAX_BUDGET:
        return f"--budget: expected <= {MAX_BUDGET}, got {args.budget}"
    if kernels_unavailable(args.impl, "cuda" if torch.cuda.is_available() else "cpu"):
        return (
            f"--impl {args.impl} needs a CUDA GPU here; use --impl ref (or set TRITON_INTERPRET=1 to run "
            "the Triton kernels through the slow CPU interpreter)"
        )
    return None


def main(args: argparse.Namespace) -> int:
    error = _argument_error(args)
    if error is not None:
        print(f"kdtree-engine tree: {error}", file=sys.stderr)
        return 2
    # The kernels run where their inputs are: on the GPU when one is asked for and present.
    kernels = args.impl in ("triton", "hopper") and torch.cuda.is_available()
    device = torch.device("cuda" if kernels else "cpu")
    g = torch.Generator().manual_seed(args.seed)
    logits = (torch.randn(1, args.depth, args.vocab, generator=g) * 2).to(device)
    tree = build_tree_from_logits(logits, args.budget, impl=args.impl)
    print(f"DDTree: L={args.depth} V={args.vocab} budget={args.budget}, {int(tree.num_nodes[0])} nodes")
    print("\n".join(render(tree)))
    verify = compile_tree(
        tree, torch.tensor([0], device=device), torch.tensor([100], device=device), impl=args.impl
    )
    print("positions:", verify.positions[0].tolist())
    print("visibility (row i: nodes that node i attends to):")
    for i, row in enumerate(verify.visibility[0].int().tolist()):
        print(f"  {i:3d} " + "".join("#" if x else "." for x in row))
    # Pretend the target agrees with the drafter's greedy chain: the walk accepts it.
    target = torch.zeros((1, tree.budget + 1), dtype=torch.long, device=device)
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
