"""Reference of the sampled (non-greedy) DDTree verify in the SGLang port's verify layout: the exact
target-only tree acceptance rule, written with integer arithmetic so that the Triton kernels
(kernels/sglang_sample.py) give the same bits on any device. Plain torch, CPU; the uniforms are inputs.

Layout: a request holds q slots; slot 0 is the root, slot j >= 1 node j with draft token
draft_tokens[b, j] and parent parents[b, j] (< j in a well-formed tree); slots from the request's size
(actual_tree_sizes[b], clamped to [1, q]) on are padding. target_probs[b, c] is the target's next-token
distribution after node c.

Fixed point: a probability p counts as P(p) = trunc(p * 2^40), an int64. For float32 (and narrower)
inputs p * 2^40 is exact, so P is the same on every device; a probability under 2^-40 counts as 0.
With p in [0, 1] and V <= MAX_VOCAB = 2^22 every sum below stays under 2^62, and int64 sums do not
depend on the order of the additions. A token id outside [0, V) has probability 0.

The rule, per request b, with u = uniform_samples[b] and u_final = uniform_final[b]:

1. Walk. Start at c = 0. The children of c are the real slots j (0 < j < size) with parents[j] == c,
   in slot order. With U = P(u[c]) (the uniform is indexed by node, as in the port), move to the first
   child j with U < sum over the children k <= j of P(target_probs[b, c, token_k]); if there is none,
   the walk stops and rejects at c. The walk makes at most q - 1 moves (the port's loop bound; a
   well-formed tree never needs more). A walk that is still moving after q - 1 moves ends at its last
   node with no child mask, as the port's does.
2. Residual. R(x) = P(target_probs[b, c, x]), except R = 0 for the child tokens of c (none when the
   walk did not reject). T = sum_x R(x), t = min(floor(float64(u_final) * float64(T)), T - 1) (one
   IEEE float64 multiply), and the next token is the first x whose inclusive prefix sum of R exceeds t:
   x is drawn with probability R(x) / T, and a token with R(x) = 0 is never drawn. If T = 0 (all the
   residual mass is under 2^-40) the next token is the non-child token of largest probability, the
   smallest id among ties (0 if every token is a child token).

Step 1 takes child j with probability p_j and rejects with probability 1 - sum_children p; step 2 then
draws x with probability p(x) / (1 - sum_children p). The committed tokens (accepted path, then the
next token) are therefore distributed as drawing from the target token by token, up to the 2^-40
resolution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FRAC_BITS = 40  # fraction bits of the fixed-point probabilities
MAX_VOCAB = 1 << 22  # keeps every int64 sum of fixed-point probabilities under 2^62


class SampleResult(NamedTuple):
    """The sampled verify of a batch, every field int64 on the CPU."""

    accepted_indices: torch.Tensor  # [bs, q] slots of the accepted path, root first, -1 after
    accepted_token_ids: torch.Tensor  # [bs, q] their draft tokens, 0 after
    accepted_lens: torch.Tensor  # [bs] path length with the root (>= 1)
    next_tokens: torch.Tensor  # [bs] the token drawn from the residual at the reject node
    reject_indices: torch.Tensor  # [bs] the node where the walk stopped
    reject_child_tokens: torch.Tensor  # [bs, q] its child tokens in slot order, 0 after
    reject_child_counts: torch.Tensor  # [bs] its number of children (0 when the walk never rejected)


def to_fixed(x: torch.Tensor) -> torch.Tensor:
    """x float (probabilities or uniforms in [0, 1]) -> int64 trunc(x * 2^40); exact for every float
    dtype up to float64, since a power-of-two scale only shifts the exponent."""
    return (x.to(torch.float64) * float(1 << FRAC_BITS)).to(torch.int64)


def _walk(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sizes: torch.Tensor,
    uniform: torch.Tensor,
):
    """Step 1 for the whole batch at once -> (accepted slots, accepted tokens, lengths, last node,
    whether the walk rejected, real-slot mask, masked parents)."""
    bs, q, vocab = target_probs.shape
    rows = torch.arange(bs)
    slot = torch.arange(q)
    real = (slot > 0) & (slot < sizes.clamp(1, q)[:, None])
    par = torch.where(real, parents, -2)
    token_ok = real & (tokens >= 0) & (tokens < vocab)
    safe_tokens = torch.where(token_ok, tokens, 0)
    path = torch.full((bs, q), -1, dtype=torch.int64)
    path_tokens = torch.zeros((bs, q), dtype=torch.int64)
    path[:, 0], path_tokens[:, 0] = 0, tokens[:, 0]
    cur = torch.zeros(bs, dtype=torch.int64)
    length = torch.ones(bs, dtype=torch.int64)
    moving = torch.ones(bs, dtype=torch.bool)
    for _ in range(q - 1):
        child = real & (par == cur[:, None]) & moving[:, None]
        probs = target_probs[rows[:, None], cur[:, None], safe_tokens]
        prefix = torch.where(child & token_ok, to_fixed(probs), 0).cumsum(1)
        u = to_fixed(uniform[rows, cur])
        nxt = torch.where(child & (u[:, None] < prefix), slot, q).amin(1)
        found = nxt < q
        take = rows[found]
        path[take, length[found]] = nxt[found]
        path_tokens[take, length[found]] = tokens[take, nxt[found]]
        length += found.long()
        cur = torch.where(found, nxt, cur)
        moving = found
    return path, path_tokens, length, cur, ~moving, real, par


def _compact_children(children: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """children [bs, q] bool, tokens [bs, q] -> [bs, q]: the children's tokens in slot order at the
    front of each row, 0 after."""
    order = torch.sort((~children).to(torch.int8), dim=1, stable=True).indices  # children first
    count = children.sum(1, keepdim=True)
    front = torch.arange(children.shape[1]) < count
    return torch.where(front, tokens.gather(1, order), 0)


def _residual(
    probs_row: torch.Tensor, child_tokens: torch.Tensor, counts: torch.Tensor, u_final: torch.Tensor
) -> torch.Tensor:
    """Step 2: probs_row [bs, V] (the reject node's target row), child_tokens [bs, q] (the first
    counts[b] of each row) -> next tokens [bs] int64."""
    bs, vocab = probs_row.shape
    listed = torch.arange(child_tokens.shape[1]) < counts[:, None]
    listed &= (child_tokens >= 0) & (child_tokens < vocab)
    column = torch.where(listed, child_tokens, vocab)  # column V collects the unlisted slots
    is_child = torch.zeros((bs, vocab + 1), dtype=torch.bool).scatter_(1, column, True)[:, :vocab]
    mass = torch.where(is_child, 0, to_fixed(probs_row))
    total = mass.sum(1)
    cut = torch.minimum((u_final.to(torch.float64) * total.to(torch.float64)).to(torch.int64), total - 1)
    ids = torch.arange(vocab)
    drawn = torch.where(mass.cumsum(1) > cut[:, None], ids, vocab).amin(1).clamp(max=vocab - 1)
    largest = torch.where(is_child, float("-inf"), probs_row.to(torch.float64)).argmax(1)  # first max
    return torch.where(total > 0, drawn, largest)


def sample_path(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    actual_tree_sizes: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_final: torch.Tensor,
) -> SampleResult:
    """target_probs [bs, q, V] float (each row a distribution, V <= MAX_VOCAB), draft_tokens / parents
    [bs, q] integer (verify layout), actual_tree_sizes [bs] integer, uniform_samples [bs, q] and
    uniform_final [bs] float in [0, 1) -> SampleResult of the rule in the module docstring."""
    target_probs = target_probs.cpu()
    tokens, parents = draft_tokens.cpu().long(), parents.cpu().long()
    bs, q, _ = target_probs.shape
    path, path_tokens, length, cur, rejected, real, par = _walk(
        target_probs, tokens, parents, actual_tree_sizes.cpu().long(), uniform_samples.cpu()
    )
    children = real & (par == cur[:, None]) & rejected[:, None]
    counts = children.sum(1)
    child_tokens = _compact_children(children, tokens)
    probs_row = target_probs[torch.arange(bs), cur]
    nxt = _residual(probs_row, child_tokens, counts, uniform_final.cpu())
    return SampleResult(path, path_tokens, length, nxt, cur, child_tokens, counts)
