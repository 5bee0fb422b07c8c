"""Golden cases for the tree ops: inputs drawn from a seed, outputs from the reference."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdtree_engine.ref import tree as ref

# name -> (seed, B, L, V, budget, logits transform)
CASES: dict[str, tuple[int, int, int, int, int, str]] = {
    "tree_random_fp32": (1, 4, 8, 50, 16, "fp32"),
    "tree_bf16_ties": (2, 3, 15, 40, 32, "bf16_coarse"),
    "tree_small_vocab": (3, 3, 6, 5, 32, "fp32"),
    "tree_depth1": (4, 2, 1, 30, 8, "fp32"),
    "tree_budget0": (5, 2, 4, 20, 0, "fp32"),
    "tree_budget1": (6, 2, 4, 20, 1, "bf16_coarse"),
    "tree_budget100": (7, 2, 16, 64, 100, "bf16_coarse"),
    "tree_tiny_vocab_ties": (8, 4, 7, 3, 16, "bf16_coarse"),
}

TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp32": lambda x: x,
    # Coarse bf16 values make exact score ties common: the tie-break decides the tree.
    "bf16_coarse": lambda x: (torch.round(x * 2) / 2).bfloat16().float(),
}


def draw_logits(seed: int, b: int, depth: int, vocab: int, transform: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return TRANSFORMS[transform](torch.randn(b, depth, vocab, generator=g, dtype=torch.float32) * 2)


def target_tokens_for(tree, seed: int) -> torch.Tensor:
    """Target tokens [B, N] that follow the tree for a while: each node's target is the token of one of
    its children (or a token no child has), so accept walks are non-trivial."""
    g = torch.Generator().manual_seed(seed + 1000)
    b, n = tree.batch_size, tree.budget + 1
    target = torch.randint(0, 1000, (b, n), generator=g) + 10_000  # no child has these tokens
    for r in range(b):
        for i in range(1, int(tree.num_nodes[r]) + 1):
            parent = int(tree.parents[r, i])
            if torch.rand((), generator=g) < 0.6:
                target[r, parent] = tree.tokens[r, i - 1]
    return target


def make_case(name: str) -> tuple[dict[str, torch.Tensor], int, dict]:
    seed, b, depth, vocab, budget, transform = CASES[name]
    logits = draw_logits(seed, b, depth, vocab, transform)
    if budget > 0:
        lp, ids = ref.logits_to_topk(logits, budget)
    else:
        lp, ids = logits.new_zeros(b, depth, 1), torch.zeros(b, depth, 1, dtype=torch.long)
    tree = ref.build_tree(lp, ids, budget)
    g = torch.Generator().manual_seed(seed + 7)
    roots = torch.randint(0, vocab, (b,), generator=g)
    starts = torch.randint(0, 100, (b,), generator=g)
    verify = ref.compile_tree(tree, roots, starts)
    target = target_tokens_for(tree, seed)
    accept = ref.accept_greedy(tree, target)
    tensors = {
        "in.logits": logits,
        "in.top_logprobs": lp,
        "in.top_ids": ids,
        "in.root_tokens": roots,
        "in.start_positions": starts,
        "in.target_tokens": target,
        "out.tokens": tree.tokens,
        "out.depths": tree.depths,
        "out.parents": tree.parents,
        "out.num_nodes": tree.num_nodes,
        "out.input_ids": verify.input_ids,
        "out.positions": verify.positions,
        "out.visibility": verify.visibility,
        "out.retrieve_index": verify.retrieve_index,
        "out.retrieve_next_token": verify.retrieve_next_token,
        "out.retrieve_next_sibling": verify.retrieve_next_sibling,
        "out.accepted": accept.accepted,
        "out.accept_len": accept.accept_len,
        "out.bonus": accept.bonus,
    }
    if verify.ancestor_bits is not None:
        tensors["out.ancestor_bits"] = verify.ancestor_bits
    params = {"budget": budget, "B": b, "L": depth, "V": vocab, "transform": transform}
    return tensors, seed, params
