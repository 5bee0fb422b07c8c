"""Reference DDTree ops: best-first build, compile for verify, greedy accept.

The build reproduces the official DDTree heap (liranringel/ddtree, `build_ddtree_tree`) exactly:
float64 scores updated incrementally in the official order, ties broken by the rank path.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from kdtree_engine.tree.types import AcceptResult, DraftTree, VerifyInputs


def build_one(lp: np.ndarray, ids: np.ndarray, budget: int):
    """One request. lp [L, K] float32, ids [L, K] int64.

    Returns (tokens [n], depths [n], parents [n + 1]) as Python lists, n <= budget.
    """
    depth_limit, k_avail = lp.shape
    topk = min(budget, k_avail)
    parents = [-1]
    tokens: list[int] = []
    depths: list[int] = []
    if budget <= 0 or depth_limit == 0:
        return tokens, depths, parents
    first = float(lp[0, 0])
    # (negated score, rank path, parent index, depth, rank, score): tuple order gives the tie-break.
    heap = [(-first, (0,), 0, 1, 0, first)]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        tokens.append(int(ids[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent)
        index = len(tokens)
        if rank + 1 < topk:
            s = score - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < depth_limit:
            s = score + float(lp[depth, 0])
            heapq.heappush(heap, (-s, ranks + (0,), index, depth + 1, 0, s))
    return tokens, depths, parents


def build_tree(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int) -> DraftTree:
    """top_logprobs [B, L, K] float32, top_ids [B, L, K] int64 (validated) -> DraftTree on their device."""
    b, depth_limit, _ = top_logprobs.shape
    lp = top_logprobs.detach().to("cpu", torch.float32).numpy()
    ids = top_ids.detach().to("cpu", torch.int64).numpy()
    tokens = np.full((b, budget), -1, dtype=np.int64)
    depths = np.full((b, budget), -1, dtype=np.int64)
    parents = np.full((b, budget + 1), -1, dtype=np.int64)
    num_nodes = np.zeros(b, dtype=np.int64)
    for i in range(b):
        tok, dep, par = build_one(lp[i], ids[i], budget)
        n = len(tok)
        tokens[i, :n], depths[i, :n], parents[i, : n + 1] = tok, dep, par
        num_nodes[i] = n
    dev = top_logprobs.device
    return DraftTree(
        tokens=torch.from_numpy(tokens).to(dev),
        depths=torch.from_numpy(depths).to(dev),
        parents=torch.from_numpy(parents).to(dev),
        num_nodes=torch.from_numpy(num_nodes).to(dev),
        max_depth=int(depth_limit),
    )


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, sorted descending, equal values ordered by smaller index first.

    torch.topk leaves the order of ties unspecified; bf16 logits tie often, so we pin it.
    """
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    greater = x > kth
    equal = x == kth
    need = k - greater.sum(-1, keepdim=True)
    chosen = greater | (equal & (torch.cumsum(equal.long(), -1) <= need))
    idx = chosen.nonzero()[:, -1].reshape(*x.shape[:-1], k)  # ascending index per row
    vals = torch.gather(x, -1, idx)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return torch.gather(vals, -1, order), torch.gather(idx, -1, order)


def logits_to_topk(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [B, L, V] -> (top_logprobs [B, L, k] float32, top_ids [B, L, k] int64),
    k = min(budget, V).

    Same float32 arithmetic as the official builder: top-k of the logits minus their logsumexp.
    """
    logits = draft_logits.float()
    k = min(budget, logits.shape[-1])
    top_vals, top_ids = topk_stable(logits, k)
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    return top_vals - log_z, top_ids


def compile_tree(tree: DraftTree, root_tokens: torch.Tensor, start_positions: torch.Tensor) -> VerifyInputs:
    """Positions, visibility, ancestor bitmask and EAGLE arrays for one batch of trees."""
    b, n = tree.batch_size, tree.budget + 1
    parents = tree.parents.cpu().numpy()
    depths = tree.depths.cpu().numpy()
    tokens = tree.tokens.cpu().numpy()
    counts = tree.num_nodes.cpu().numpy()
    roots = root_tokens.cpu().numpy()
    starts = start_positions.cpu().numpy()

    input_ids = np.zeros((b, n), np.int64)
    positions = np.zeros((b, n), np.int64)
    vis = np.zeros((b, n, n), np.bool_)
    index = np.full((b, n), -1, np.int64)
    next_token = np.full((b, n), -1, np.int64)
    next_sibling = np.full((b, n), -1, np.int64)
    for r in range(b):
        used = int(counts[r]) + 1
        input_ids[r, 0], input_ids[r, 1:used] = roots[r], tokens[r, : used - 1]
        positions[r, :] = starts[r]
        positions[r, 1:used] += depths[r, : used - 1]
        index[r, :used] = r * n + np.arange(used)
        last_child = {}
        for i in range(n):
            vis[r, i, i] = True
            if i == 0 or i >= used:
                continue
            p = int(parents[r, i])
            vis[r, i, :i] |= vis[r, p, :i]
            if p in last_child:
                next_sibling[r, last_child[p]] = i
            else:
                next_token[r, p] = i
            last_child[p] = i
    bits = None
    if n <= 64:
        weights = np.array([1 << j for j in range(n)], dtype=np.uint64)
        bits = (vis.astype(np.uint64) * weights).sum(-1, dtype=np.uint64).view(np.int64)
    dev = tree.device

    def out(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    return VerifyInputs(
        input_ids=out(input_ids),
        positions=out(positions),
        visibility=out(vis),
        ancestor_bits=None if bits is None else out(bits),
        retrieve_index=out(index),
        retrieve_next_token=out(next_token),
        retrieve_next_sibling=out(next_sibling),
    )


def walk(tokens: np.ndarray, parents: np.ndarray, count: int, target: np.ndarray) -> list[int]:
    """Accepted node indices of one tree, root first. A later sibling with the same token wins,
    as in the official child maps (dict overwrite); top-k ids are distinct, so it never arises there."""
    children: list[dict[int, int]] = [dict() for _ in range(count + 1)]
    for i in range(1, count + 1):
        children[int(parents[i])][int(tokens[i - 1])] = i
    path = [0]
    while int(target[path[-1]]) in children[path[-1]]:
        path.append(children[path[-1]][int(target[path[-1]])])
    return path


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """target_tokens [B, N] int64: the target's token at every tree node (argmax, or a sample)."""
    b = tree.batch_size
    tokens = tree.tokens.cpu().numpy()
    parents = tree.parents.cpu().numpy()
    counts = tree.num_nodes.cpu().numpy()
    target = target_tokens.cpu().numpy()
    accepted = np.full((b, tree.max_depth + 1), -1, np.int64)
    lengths = np.zeros(b, np.int64)
    bonus = np.zeros(b, np.int64)
    for r in range(b):
        path = walk(tokens[r], parents[r], int(counts[r]), target[r])
        accepted[r, : len(path)] = path
        lengths[r] = len(path)
        bonus[r] = target[r, path[-1]]
    dev = tree.device
    return AcceptResult(
        accepted=torch.from_numpy(accepted).to(dev),
        accept_len=torch.from_numpy(lengths).to(dev),
        bonus=torch.from_numpy(bonus).to(dev),
    )
