"""What a round of the auto budget tells its policy (engine/budget.py), as torch ops: the reference of
kernels/round_report.py. A best-first tree's nodes come out in decreasing draft path probability, so the
first k nodes of a round's tree are the tree of bucket k: a round of bucket n reports, per request, the
sum S of the first k path probabilities at every bucket k <= n (and the chain's S), and the tokens each
smaller tree would have committed on the same round. Device ops only: capturable, nothing read on the
host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kdtree_engine.tree_types import DraftTree


def path_probabilities(
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    tokens: torch.Tensor,
    depths: torch.Tensor,
    visibility: torch.Tensor,
) -> torch.Tensor:
    """The draft path probability of every tree node: top_logprobs / top_ids [B, L, K] (the top-k the
    tree was built from: tree.ops.logits_topk); tokens / depths [B, n] (node i + 1's token and 1-based
    depth, -1 where unused); visibility [B, n + 1, n + 1] bool (node i sees its ancestors and itself;
    row 0 the root) -> [B, n] float32, 0 for unused nodes. Each node's own log-probability is its
    token's among the top-k of its depth (every node is one of them), summed over its ancestors through
    the visibility mask. Device ops only (capturable), over [B, n, K]: the vocabulary is not read."""
    b, n = tokens.shape
    if n == 0:
        return torch.zeros(b, 0, dtype=torch.float32, device=tokens.device)
    k = top_ids.shape[-1]
    used = tokens >= 0
    at = (depths - 1).clamp(min=0)[..., None].expand(-1, -1, k)  # [B, n, K]: the node's depth row
    match = top_ids.gather(1, at) == tokens[..., None]
    node_lp = torch.where(match, top_logprobs.gather(1, at), 0.0).sum(dim=-1)  # [B, n]
    node_lp = torch.where(used, node_lp, 0.0)
    ancestors = visibility[:, 1:, 1:].to(torch.float32)  # [B, n, n]: node i sees node j (root dropped)
    path_lp = torch.bmm(ancestors, node_lp[..., None]).squeeze(-1)  # [B, n]
    return torch.where(used, path_lp.exp(), 0.0)


def bucket_sums(probs: torch.Tensor, buckets: Sequence[int]) -> torch.Tensor:
    """probs [B, n] (nodes in best-first order) -> [B, len(buckets)] float32: the sum of the first
    min(k, n) probabilities for each bucket k. Device ops only (capturable: no index tensor copied
    from the host)."""
    b, n = probs.shape
    cum = torch.cat([probs.new_zeros(b, 1), probs.float().cumsum(dim=1)], dim=1)  # [B, n + 1]
    return torch.stack([cum[:, min(k, n)] for k in buckets], dim=1)


def chain_sums(top_logprobs: torch.Tensor) -> torch.Tensor:
    """S of the chain: the sum of its nodes' path probabilities, node d's the product of the top-1
    probabilities of drafted positions 1..d. top_logprobs [B, L, K] (tree.ops.logits_topk: each
    position's top-k, largest first) -> [B] float32. Device ops only."""
    return top_logprobs[..., 0].float().cumsum(dim=1).exp().sum(dim=1)


def round_sums(
    probs: torch.Tensor, top_logprobs: torch.Tensor, buckets: Sequence[int], n: int, chain: int | None
) -> torch.Tensor:
    """What a round of bucket n tells of S at every bucket ([B, len(buckets)] float32, NaN where it
    tells nothing). probs [B, n] the path probabilities of its tree's nodes, top_logprobs the top-k
    the tree was built from, chain the chain's bucket (None: none). A best-first tree of n nodes tells
    the first-k sums at every tree bucket k <= n and the chain's S (the top-1 of each position is in
    any top-k); the chain's round (n == chain) tells its own S only. Device ops only."""
    nan = probs.new_full((probs.shape[0],), float("nan"))
    if n == chain:
        own = probs.sum(dim=1)
        return torch.stack([own if k == chain else nan for k in buckets], dim=1)
    trees = [k for k in buckets if k != chain and k <= n]
    built = bucket_sums(probs, trees)
    columns = []
    for k in buckets:
        if k == chain:
            columns.append(chain_sums(top_logprobs))
        else:
            columns.append(built[:, trees.index(k)] if k in trees else nan)
    return torch.stack(columns, dim=1)


def smaller_trees(buckets: Sequence[int], n: int, chain: int | None) -> list[int]:
    """The tree buckets below bucket n whose counts a round of n tells (would_commit): every k with
    0 < k < n but the chain's; none for the chain's own round (the chain is no tree's prefix)."""
    if n == chain:
        return []
    return [k for k in buckets if 0 < k < n and k != chain]


def told_counts(buckets: Sequence[int], n: int, chain: int | None) -> set[int]:
    """The buckets whose committed tokens a round of bucket n tells: its own and its smaller trees'."""
    return {n, *smaller_trees(buckets, n, chain)}


def would_commit(accepted: torch.Tensor, buckets: Sequence[int], n: int, chain: int | None) -> torch.Tensor:
    """What a round of bucket n tells of the tokens each smaller tree would have committed on the same
    round ([B, len(buckets)] float32, NaN where it tells nothing). accepted [B, L + 1]: the accepted
    node indices of its tree (the root 0 first, -1 padded). A best-first tree of k nodes is the first k
    nodes of the tree of n >= k, and node indices grow along a path, so the tree of k accepts exactly
    the accepted nodes of index <= k (greedy, and sampled with the walk's shared draws): it commits 1 +
    their count. The chain's round tells its own count only; a tree round tells nothing of the chain
    (its nodes need not be in the tree). Device ops only."""
    nodes = accepted[:, 1:]
    nan = nodes.new_full((nodes.shape[0],), float("nan"), dtype=torch.float32)
    told = told_counts(buckets, n, chain)
    columns = []
    for k in buckets:
        if k in told:
            columns.append(1.0 + ((nodes > 0) & (nodes <= k)).sum(dim=1).float())
        else:
            columns.append(nan)
    return torch.stack(columns, dim=1)


@dataclass(frozen=True)
class ReportCodes:
    """What each column of a round of bucket n reports (round_report): sums[j] >= 0 the sum of the
    first sums[j] path probabilities, -2 the chain's S, -1 NaN; would[j] >= 1 the tokens the tree of
    would[j] nodes would have committed, -1 NaN. The device copies are made once, outside any capture
    (a captured graph cannot copy from the host)."""

    buckets: tuple[int, ...]
    n: int
    chain: int | None
    sums: torch.Tensor  # [len(buckets)] int32 on the round's device
    would: torch.Tensor  # [len(buckets)] int32


def report_codes(buckets: Sequence[int], n: int, chain: int | None, device: torch.device) -> ReportCodes:
    """The columns of a round of bucket n: round_sums's and would_commit's rules as codes."""
    if n == chain:
        sums = [n if k == chain else -1 for k in buckets]
    else:
        sums = [-2 if k == chain else (k if k <= n else -1) for k in buckets]
    told = told_counts(buckets, n, chain)
    would = [k if k in told else -1 for k in buckets]
    codes = torch.tensor([sums, would], dtype=torch.int32, device=device)
    return ReportCodes(tuple(buckets), n, chain, codes[0], codes[1])


def round_report_ref(
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    tree: DraftTree,
    visibility: torch.Tensor,
    accepted: torch.Tensor,
    codes: ReportCodes,
) -> torch.Tensor:
    """The round's report for its policy ([B, 2 len(buckets)] float64, the round's copy's format): the
    bucket sums (round_sums of the tree's path_probabilities), then the counts each smaller tree would
    have committed (would_commit). top_logprobs / top_ids the top-k the tree was built from (the
    chain's round: the top-1), tree the bucket's, visibility its compiled mask, accepted the walk's
    node indices."""
    probs = path_probabilities(top_logprobs, top_ids, tree.tokens, tree.depths, visibility)
    sums = round_sums(probs, top_logprobs, codes.buckets, codes.n, codes.chain)
    would = would_commit(accepted, codes.buckets, codes.n, codes.chain)
    return torch.cat([sums, would], dim=1).double()
