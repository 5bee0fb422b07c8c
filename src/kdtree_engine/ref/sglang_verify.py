"""Verify-side tree ops in the SGLang DDTree port's layout (the specification of the drop-in's
`compile_ddtree_tree` and `follow_verified_tree_gpu`; plain torch, CPU).

Layout ("verify layout"): a request's tree has q slots; slot 0 is the root and slot i (i >= 1) holds
node i, whose draft token is node_token_ids[:, i - 1] and depth node_depths[:, i - 1]. parents[:, i] < i
for the real slots i < size (parents[:, 0] = -1); the slots from `size` on are padding. visibility
[B, >= q, >= q] bool marks, in row i, node i and its ancestors.

A slot count taken from `sizes` is clamped to [0, q] by the compile ops and to [1, q] by the path
follower (the root always exists there), so every size gives a defined result.
"""

from __future__ import annotations

import torch


def _clamped(sizes: torch.Tensor, q: int, low: int) -> list[int]:
    """Host ints of sizes[:B], each clamped to [low, q]."""
    return [min(max(int(s), low), q) for s in sizes.tolist()]


def verify_inputs(
    root_token_ids: torch.Tensor,
    node_token_ids: torch.Tensor,
    node_depths: torch.Tensor,
    start_positions: torch.Tensor,
    q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (input ids [B, q], positions [B, q]) int64: slot 0 is the root (token root_token_ids[b],
    position start_positions[b]); slot i >= 1 is node i (its draft token, start + its depth).
    Padding slots are filled the same way from whatever the node buffers hold there."""
    b = root_token_ids.shape[0]
    start = start_positions[:b].long().unsqueeze(1)
    ids = torch.cat([root_token_ids.long().unsqueeze(1), node_token_ids[:b, : q - 1].long()], dim=1)
    depth = torch.cat([torch.zeros((b, 1), dtype=torch.long), node_depths[:b, : q - 1].long()], dim=1)
    return ids, start + depth


def pad_visibility_(visibility: torch.Tensor, sizes: torch.Tensor, q: int) -> None:
    """In place: for each request b, rows size_b .. q - 1 of visibility[b, :q, :q] become self-only
    (True on the diagonal, False elsewhere); real rows and everything past column / row q are kept."""
    eye = torch.eye(q, dtype=torch.bool)
    for b, size in enumerate(_clamped(sizes, q, 0)):
        visibility[b, size:q, :q] = eye[size:]


def request_mask(visibility: torch.Tensor, size: int, past: int, q: int) -> torch.Tensor:
    """One request's allow-mask [q, past + q]: a real query row (< size) sees the whole committed prefix
    and, among the tree slots, exactly its visibility row restricted to the real slots; a padding row
    sees only its own slot."""
    real = torch.arange(q) < size
    both_real = real[:, None] & real[None, :]
    tree = torch.where(both_real, visibility[:q, :q], torch.eye(q, dtype=torch.bool) & ~real[:, None])
    prefix = real[:, None].expand(q, past)
    return torch.cat([prefix, tree], dim=1)


def packed_tree_mask(
    visibility: torch.Tensor, sizes: torch.Tensor, past_lengths: torch.Tensor, q: int
) -> torch.Tensor:
    """The request-packed bool allow-mask: the flattened request_mask of every request, in request
    order, so request b starts at q * sum_{r < b} (past_r + q) and the total is q * sum_b (past_b + q)."""
    b = len(sizes)
    pasts = [int(p) for p in past_lengths[:b].tolist()]
    parts = [
        request_mask(visibility[r], size, pasts[r], q).reshape(-1)
        for r, size in enumerate(_clamped(sizes, q, 0))
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def follow_verified_path(
    draft_tokens: torch.Tensor,
    target_predict: torch.Tensor,
    parents: torch.Tensor,
    sizes: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy accepted path of each request (draft_tokens / target_predict / parents [B, q]).

    Starting at the root, the target's prediction at the current node names the wanted next token; the
    walk moves to the lowest-numbered real child (1 <= j < size, parents[j] = current) drafted with that
    token and repeats, and stops when no child matches. Returns (accepted indices [B, q]: the path's
    nodes from the root, then -1; accepted token ids [B, q]: their draft tokens, then 0; accepted lengths
    [B] >= 1; next tokens [B]: the prediction at the last accepted node), all int64.
    """
    b, q = draft_tokens.shape
    indices = torch.full((b, q), -1, dtype=torch.long)
    tokens = torch.zeros((b, q), dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    nexts = torch.zeros(b, dtype=torch.long)
    for r, size in enumerate(_clamped(sizes[:b], q, 1)):
        drafted, predicted = draft_tokens[r].tolist(), target_predict[r].tolist()
        parent = parents[r].tolist()
        path = [0]
        while True:
            want = predicted[path[-1]]
            child = next((j for j in range(1, size) if parent[j] == path[-1] and drafted[j] == want), None)
            if child is None or len(path) == q:
                break
            path.append(child)
        indices[r, : len(path)] = torch.tensor(path)
        tokens[r, : len(path)] = torch.tensor([drafted[j] for j in path])
        lengths[r], nexts[r] = len(path), want
    return indices, tokens, lengths, nexts
