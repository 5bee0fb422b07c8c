"""The DDTree worker's draft top-k step (`DDTreeWorkerV2._compute_draft_topk_log_probs_and_token_ids`
in the SGLang port) on our exact fused top-k.

The port computes the draft logits of each tensor-parallel rank's vocabulary shard in float32, then
torch.topk plus a logsumexp, gathering maxima, exp-sums and candidates over the ranks. Ours: on one
rank, the fused top-k kernel reads the logits once in their own dtype and returns the top-k log-probs
(ties: smaller id first) with the exact log-softmax normalizer; over several ranks, each rank sends
its raw top-k and the normalizer's block partials and every rank merges them exactly
(integrations.sharded_topk), so the result is the same as on one rank, bit for bit.
"""

from __future__ import annotations

import torch

from kdtree_engine.integrations.sglang.replay import replayed
from kdtree_engine.integrations.sharded_topk import NORM_BLOCK, merge_gathered, shard_partials
from kdtree_engine.ref import tree as ref_tree


def _pad_columns(x: torch.Tensor, width: int, value) -> torch.Tensor:
    if x.shape[-1] >= width:
        return x
    pad = x.new_full((*x.shape[:-1], width - x.shape[-1]), value)
    return torch.cat([x, pad], dim=-1)


@replayed(device_arg="logits")
def whole_vocab_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V] -> ([T, topk] float32 log-probs, [T, topk] int64 ids); columns past V hold -inf / 0
    (the port's padding when topk > V). On CUDA a call repeating on the same logits buffer replays a
    graph (replay.py) whose outputs are the same two tensors every time: a result is valid until the
    next call on that buffer (the worker consumes it at once, in the tree build)."""
    k = min(topk, logits.shape[-1])
    if logits.is_cuda:
        from kdtree_engine.kernels.tree_topk import logits_topk

        lp, ids = logits_topk(logits.unsqueeze(0), k)
    else:
        lp, ids = ref_tree.logits_to_topk(logits.unsqueeze(0), k)
    return _pad_columns(lp[0], topk, float("-inf")), _pad_columns(ids[0], topk, 0)


def _gather(group, local: torch.Tensor) -> torch.Tensor:
    """[world, *local.shape]: every rank's `local`, in rank order (SGLang's GroupCoordinator API)."""
    out = local.new_empty((group.world_size, *local.shape))
    group.all_gather_into_tensor(out, local.contiguous())
    return out


def draft_topk(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    topk: int,
    *,
    vocab_start: int = 0,
    group=None,
    blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden_states [T, H] @ weight[Vs, H].T = this rank's draft logits over global ids vocab_start ..
    vocab_start + Vs - 1 -> (log-probs [T, topk] float32, ids [T, topk] int64) over the whole vocabulary.

    group: None (one rank) or a tensor-parallel group with `world_size` and
    `all_gather_into_tensor(out, in)` whose ranks hold consecutive shards, each starting at a multiple of
    NORM_BLOCK tokens. blocks: the normalizer partials each rank sends (ceil(shard size / NORM_BLOCK)
    of the largest shard; the default is this rank's), so that the gathered tensors have one shape.
    A topk below 1 is a ValueError naming it (shard_logits_topk's check)."""
    if hidden_states.dtype != weight.dtype:
        hidden_states = hidden_states.to(weight.dtype)
    logits = torch.mm(hidden_states, weight.t())
    return shard_logits_topk(logits, topk, vocab_start=vocab_start, group=group, blocks=blocks)


def shard_logits_topk(
    logits: torch.Tensor,
    topk: int,
    *,
    vocab_start: int = 0,
    group=None,
    blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_topk after the vocab matmul: logits [T, Vs] of this rank's shard (global ids vocab_start ..
    vocab_start + Vs - 1) -> (log-probs [T, topk] float32, ids [T, topk] int64) over the whole
    vocabulary; group and blocks as in draft_topk. Over several ranks: shard_partials, two all-gathers
    (floats: top-k values and block maxima; ints: ids and block sums), merge_gathered on every rank."""
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    if group is None or group.world_size == 1:
        lp, ids = whole_vocab_topk(logits, topk)
        return lp, (ids + vocab_start if vocab_start else ids)
    if vocab_start % NORM_BLOCK:
        raise ValueError(
            f"vocab_start: a shard must start on a multiple of {NORM_BLOCK} tokens, got {vocab_start}"
        )
    part = shard_partials(logits, vocab_start, topk)
    nb = blocks if blocks is not None else part.block_max.shape[-1]
    values = _pad_columns(part.values, topk, float("-inf"))
    floats = torch.cat([values, _pad_columns(part.block_max, nb, float("-inf"))], dim=-1)
    ints = torch.cat([_pad_columns(part.ids, topk, 0), _pad_columns(part.block_sum, nb, 0)], dim=-1)
    floats, ints = _gather(group, floats), _gather(group, ints)  # [world, T, topk + nb]

    def by_rank(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return x[..., lo:hi].permute(1, 0, 2).reshape(x.shape[1], -1)  # [T, world * width], rank order

    return merge_gathered(
        by_rank(floats, 0, topk),
        by_rank(ints, 0, topk),
        by_rank(floats, topk, topk + nb),
        by_rank(ints, topk, topk + nb),
        topk,
    )


def compute_draft_topk_log_probs_and_token_ids(self, hidden_states: torch.Tensor, lm_head, topk: int):
    """The worker method's signature: hidden_states [T, H], SGLang's vocab-parallel lm_head (its
    `shard_indices` and `weight`), topk -> (log-probs [T, topk] float32, global ids [T, topk] int64).
    Shards with added (extra) vocabulary are refused (the port's shard layout puts them after the
    padding, off our block grid)."""
    if topk <= 0:
        raise ValueError(f"topk: DDTree topk must be positive, got {topk}")
    if hidden_states.numel() == 0:
        dev = hidden_states.device
        return torch.empty((0, topk), dtype=torch.float32, device=dev), torch.empty(
            (0, topk), dtype=torch.long, device=dev
        )
    shard = lm_head.shard_indices
    if int(shard.num_added_elements) > 0:
        raise ValueError(
            "lm_head: added-vocabulary shards are not supported by the kdtree-engine draft top-k"
        )
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    num_org = int(shard.num_org_elements)
    blocks = -(-int(shard.num_org_elements_padded) // NORM_BLOCK)
    return draft_topk(
        hidden_states,
        lm_head.weight[:num_org],
        topk,
        vocab_start=int(shard.org_vocab_start_index),
        group=group,
        blocks=blocks,
    )
