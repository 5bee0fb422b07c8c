"""A built DraftTree in the SGLang DDTree port's layout (the reference of the drop-in's build).

The port keeps a tree as: node_token_ids / node_depths [B, budget] (node i+1 at column i, unused
columns 0), parents [B, budget + 1] (root and unused -1), visibility [B, budget + 1, budget + 1] bool
(row i: node i and its ancestors; rows of unused nodes all False) and actual_tree_sizes [B] (nodes
with the root).
"""

from __future__ import annotations

import torch

from kdtree_engine.tree_types import DraftTree


def ancestor_visibility(parents: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (parents[:, 0] = -1, a parent numbered before its child), sizes [B] -> [B, N, N]
    bool: row i of request b marks i and its ancestors for i < sizes[b], rows past it all False."""
    b, n = parents.shape
    vis = torch.zeros((b, n, n), dtype=torch.bool)
    for r in range(b):
        for i in range(int(sizes[r])):
            p = int(parents[r, i])
            if p >= 0:
                vis[r, i] = vis[r, p]
            vis[r, i, i] = True
    return vis


def write_port_layout(
    tree: DraftTree,
    tokens: torch.Tensor,
    depths: torch.Tensor,
    parents: torch.Tensor,
    visibility: torch.Tensor,
    sizes: torch.Tensor,
) -> None:
    """Writes `tree` into rows [:B] of the port's buffers (any device; see the module docstring)."""
    b, budget = tree.batch_size, tree.budget
    used = tree.tokens >= 0
    sizes_cpu = tree.num_nodes.cpu() + 1
    tokens[:b, :budget] = torch.where(used, tree.tokens, 0).to(tokens.device)
    depths[:b, :budget] = torch.where(used, tree.depths, 0).to(depths.device)
    parents[:b, : budget + 1] = tree.parents.to(parents.device)
    sizes[:b] = sizes_cpu.to(sizes.device)
    vis = ancestor_visibility(tree.parents.cpu(), sizes_cpu)
    visibility[:b, : budget + 1, : budget + 1] = vis.to(visibility.device)
