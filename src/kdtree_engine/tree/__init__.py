"""DraftTree types and the public tree ops."""

from kdtree_engine.tree.ops import (
    accept_greedy,
    accept_sampled,
    build_tree,
    build_tree_from_logits,
    compile_tree,
    logits_topk,
)
from kdtree_engine.tree_types import AcceptResult, DraftTree, VerifyInputs

__all__ = [
    "AcceptResult",
    "DraftTree",
    "VerifyInputs",
    "accept_greedy",
    "accept_sampled",
    "build_tree",
    "build_tree_from_logits",
    "compile_tree",
    "logits_topk",
]
