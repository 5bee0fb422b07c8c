"""Golden cases for the tree-verify MLA attention: small latent dims, real DDTree masks, NaN in every
cache slot the op must not read. Outputs come from the float32 reference."""

from __future__ import annotations

import torch

from kdtree_engine.ref import mla_attention as ref
from kdtree_engine.ref import tree as ref_tree

# name -> (seed, prefix lengths per request, tree budget (t = budget + 1), heads, d_c, d_r)
CASES: dict[str, tuple[int, tuple[int, ...], int, int, int, int]] = {
    "attention_decode": (11, (0, 1, 37), 0, 4, 32, 8),
    "attention_tree_ragged": (12, (5, 64, 0), 8, 2, 32, 8),
    "attention_tree_long": (13, (130,), 16, 3, 64, 16),
}


def tree_visibility(seed: int, b: int, budget: int) -> torch.Tensor:
    """[b, t, t] ancestor-or-self masks of DDTree trees built from random drafter logits."""
    if budget == 0:
        return torch.ones(b, 1, 1, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, 4, 6, generator=g) * 2
    tree = ref_tree.build_tree(*ref_tree.logits_to_topk(logits, budget), budget)
    roots, starts = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    return ref_tree.compile_tree(tree, roots, starts).visibility


def make_case(name: str) -> tuple[dict[str, torch.Tensor], int, dict]:
    seed, prefixes, budget, heads, d_c, d_r = CASES[name]
    b, t = len(prefixes), budget + 1
    lengths = torch.tensor([p + t for p in prefixes])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, heads, d_c + d_r, generator=g)
    kv = torch.randn(b, int(lengths.max()) + 3, d_c + d_r, generator=g)
    for r in range(b):
        kv[r, int(lengths[r]) :] = float("nan")  # unread: a read shows up as NaN in the output
    vis = tree_visibility(seed, b, budget)
    scale = (d_c // 4 + d_r) ** -0.5
    out, lse = ref.tree_mla_attention(q, kv, lengths, vis, scale, d_c)
    tensors = {
        "in.q": q, "in.kv_cache": kv, "in.cache_seqlens": lengths, "in.visibility": vis,
        "out.out": out, "out.lse": lse,
    }  # fmt: skip
    return tensors, seed, {"softmax_scale": scale, "d_v": d_c}
