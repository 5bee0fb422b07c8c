"""Triton implementations of the ops in ref/, one file per op; `kernels.tree` is the tree-op facade."""
