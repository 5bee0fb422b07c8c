"""Triton implementations of the ops in ref/, one file per op (tree.ops and the model dispatch to them).
TREE_KERNELS names the tree ops' modules, for a caller that must import them all at once (tests that
fix how the interpreter is configured when a module is first imported)."""

TREE_KERNELS = tuple(
    f"kdtree_engine.kernels.tree_{op}" for op in ("accept", "build", "compile", "sample", "topk")
)
