"""The draft top-k over a tensor-parallel vocabulary: each rank holds the draft logits of its shard
only; the result must be what `logits_to_topk` gives on the whole vocabulary, bit for bit.

Each rank computes `shard_partials` on its shard: its own top-k (values and global ids, ties: smaller
id first) and the first pass of our log-softmax normalizer (`ref.tree.block_partials`: per block of
NORM_BLOCK logits its maximum and an exact int64 sum). After an all-gather (k + 2 * blocks numbers per
row and rank), any rank calls `merge_partials`: the top-k of the gathered candidates ordered by value,
then id (every token of the global top-k is in its own shard's top-k, so the merge is exact and keeps
the tie order), minus the normalizer combined from all blocks (the combine adds exact integers, so it
is the same float32 as on the whole row). This holds when every shard but the last spans a multiple
of NORM_BLOCK tokens, so that shard blocks are blocks of the whole row: 163840 / 8 = 20480 = 10 x 2048.

Inside SGLang the all-gather is its tensor-parallel GroupCoordinator's; `TorchGroup` gives a plain
torch.distributed process group (gloo, NCCL) the same two members, for runs without SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kdtree_engine.ref.tree import NORM_BLOCK, block_partials, combine_block_partials, topk_stable


@dataclass(frozen=True)
class ShardPartials:
    """One rank's contribution for rows [...]: values/ids [..., k'] (k' = min(k, shard size), ids
    global, sorted by value then id), block_max [..., nb] float32, block_sum [..., nb] int64."""

    values: torch.Tensor
    ids: torch.Tensor
    block_max: torch.Tensor
    block_sum: torch.Tensor


def shard_partials(
    logits: torch.Tensor, vocab_start: int, k: int, *, block: int = NORM_BLOCK
) -> ShardPartials:
    """logits [..., Vs]: this rank's shard of the draft logits, covering global ids vocab_start ..
    vocab_start + Vs - 1. k: the tree's top-k (min(budget, V))."""
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    if vocab_start < 0 or vocab_start % block:
        raise ValueError(
            f"vocab_start: expected a multiple of {block} (a shard starts on a block), got {vocab_start}"
        )
    k = min(k, logits.shape[-1])
    if logits.is_cuda and block == NORM_BLOCK:  # the fused kernel: one pass, no host sync
        from kdtree_engine.kernels.tree_topk import shard_topk

        lead = logits.shape[:-1]
        values, ids, block_max, block_sum = shard_topk(logits.reshape(1, -1, logits.shape[-1]), k)
        values, ids = values.reshape(*lead, k), ids.reshape(*lead, k)
        block_max, block_sum = block_max.reshape(*lead, -1), block_sum.reshape(*lead, -1)
        return ShardPartials(values, ids + vocab_start, block_max, block_sum)
    x = logits.float()
    values, ids = topk_stable(x, k)
    block_max, block_sum = block_partials(x, block=block)
    return ShardPartials(values, ids + vocab_start, block_max, block_sum)


def merge_partials(parts: list[ShardPartials], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered partials of every shard, in vocabulary order -> (top_logprobs [..., k] float32,
    top_ids [..., k] int64), equal to logits_to_topk of the whole vocabulary (k <= the vocabulary)."""
    if not parts:
        raise ValueError("parts: expected the partials of at least one shard")
    if k < 1 or k > sum(p.values.shape[-1] for p in parts):
        raise ValueError(
            f"k: expected 1..{sum(p.values.shape[-1] for p in parts)} (the shards' top-k), got {k}"
        )
    return merge_gathered(
        torch.cat([p.values for p in parts], dim=-1),
        torch.cat([p.ids for p in parts], dim=-1),
        torch.cat([p.block_max for p in parts], dim=-1),
        torch.cat([p.block_sum for p in parts], dim=-1),
        k,
    )


def merge_gathered(values, ids, block_max, block_sum, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_partials on the concatenated partials of every shard, in vocabulary order (what an
    all-gather gives): values / ids [..., n], block_max / block_sum [..., nb]. Sort-based, so no host
    synchronisation: in that order equal values already stand in id order (each shard's are, and a
    later shard's ids are larger), which a stable sort keeps."""
    top_vals, pos = torch.sort(values, dim=-1, descending=True, stable=True)
    top_vals, pos = top_vals[..., :k], pos[..., :k]
    return top_vals - combine_block_partials(block_max, block_sum), ids.gather(-1, pos)


def check_shards(sizes: list[int], *, block: int = NORM_BLOCK) -> None:
    """ValueError unless every shard but the last spans a multiple of `block` tokens."""
    bad = [i for i, s in enumerate(sizes[:-1]) if s % block]
    if bad:
        raise ValueError(f"shards: shard {bad[0]} has {sizes[bad[0]]} tokens, not a multiple of {block}")


@dataclass(frozen=True)
class TorchGroup:
    """A torch.distributed process group (None: the default one) with the two members of SGLang's
    GroupCoordinator that the drop-in's draft top-k calls: `world_size` and
    `all_gather_into_tensor(out, in)`, `out` [world, *in.shape] filled in rank order."""

    group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out [world, *inp.shape] contiguous, inp [...] contiguous, one dtype and device (as the group's
        backend needs: CPU for gloo, this rank's GPU for NCCL)."""
        if not (out.is_contiguous() and inp.is_contiguous()) or out.numel() != inp.numel() * self.world_size:
            raise ValueError(
                f"out: expected a contiguous [{self.world_size}, *{tuple(inp.shape)}] tensor beside a "
                f"contiguous input, got {tuple(out.shape)}"
            )
        # flat views: gloo splits the output along its first dim only, NCCL takes either layout
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), inp.view(-1), group=self.group)
