"""A tree round's commit on the device, after the walk and the cache compaction: what the round hands
the drafter (the accepted nodes' target features and their count), the host (the count and the
committed tokens, in the round's one copy) and the next round (the bonus token and the cache length).

`commit_round_ref` is the specification (torch ops, about a dozen small kernels); `commit_round` runs
it in one launch on a kernel impl (kernels/round_commit.py), with the same values bit for bit (copies
and integer arithmetic only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kdtree_engine.impl import resolve_impl


class RoundState(NamedTuple):
    """The tensors a round's commit writes, in place: ctx [B, W, F] (a view: the drafter's next context
    rows, row i the features of the accepted node i, the root's first), ctx_lens [B], committed
    [B, 1 + slots + ...] int64 (a view of the round's copy: the count, then `slots` token columns), bonus
    [B] and start [B] int64 (the state's last committed token and cache length)."""

    ctx: torch.Tensor
    ctx_lens: torch.Tensor
    committed: torch.Tensor
    bonus: torch.Tensor
    start: torch.Tensor


def commit_round_ref(count: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, ids: torch.Tensor,
                     hidden: torch.Tensor, active: torch.Tensor, out: RoundState,
                     slots: int) -> None:  # fmt: skip
    """count [B] int64: tokens committed per request (0 for a finished one); accepted [B, W] int64: the
    accepted node indices, the root first, -1 padded; bonus [B] int64: the target's token after the last
    accepted node; ids [B, N] int64: the verified nodes' tokens; hidden [B, N, F]: their target features;
    active [B] bool. Writes, in place:

    - out.ctx[b, i] = hidden[b, max(accepted[b, i], 0)] for every i < W, and out.ctx_lens = count;
    - out.committed[b, 0] = count[b]; columns 1 .. W: the tokens of accepted nodes 1 .. W - 1 (-1 padded
      slots read node 0's) then the bonus token, with the bonus written again at slot
      max(count[b] - 1, 0) (so the first count[b] slots are what the request commits); columns
      W + 1 .. slots: 0;
    - out.bonus[b] = bonus[b] where active[b]; out.start[b] += count[b]."""
    w = accepted.shape[1]
    idx = accepted.clamp(min=0)
    out.ctx.copy_(hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1])))
    out.ctx_lens.copy_(count)
    tokens = torch.cat([ids.gather(1, idx)[:, 1:], bonus[:, None]], dim=1)
    tokens.scatter_(1, (count - 1).clamp(min=0)[:, None], bonus[:, None])
    out.committed[:, 0] = count
    out.committed[:, 1 : 1 + w] = tokens
    out.committed[:, 1 + w : 1 + slots] = 0
    out.bonus.copy_(torch.where(active, bonus, out.bonus))
    out.start.add_(count)


def commit_round(count: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, ids: torch.Tensor,
                 hidden: torch.Tensor, active: torch.Tensor, out: RoundState, slots: int,
                 impl: str | None = None) -> None:  # fmt: skip
    """commit_round_ref, in one launch on a kernel impl (`impl` as every op's). Internal to the engine:
    its inputs are the round's own tensors, not checked (slots >= W)."""
    if resolve_impl(impl, accepted.device) == "ref":
        commit_round_ref(count, accepted, bonus, ids, hidden, active, out, slots)
        return
    from kdtree_engine.kernels.round_commit import commit_round as kernel_commit

    kernel_commit(count, accepted, bonus, ids, hidden, active, out, slots)
