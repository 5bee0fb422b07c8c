"""The sharded draft top-k equals the top-k of the whole vocabulary, bit for bit, ties included."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.integrations.sharded_topk import check_shards, merge_partials, shard_partials
from kdtree_engine.ref.tree import logits_to_topk

BLOCK = 16  # a small normalizer block: the same code paths as 2048 at test sizes


def _sharded(logits: torch.Tensor, shards: int, k: int, block: int = BLOCK):
    size = -(-logits.shape[-1] // shards)
    size = -(-size // block) * block  # shards start on blocks; the last one is ragged
    parts = [
        shard_partials(logits[..., s : s + size], s, k, block=block) for s in range(0, logits.shape[-1], size)
    ]
    check_shards([min(size, logits.shape[-1] - s) for s in range(0, logits.shape[-1], size)], block=block)
    return merge_partials(parts, k)


def _inputs(kind: str, gen: torch.Generator) -> torch.Tensor:
    shape = (3, 5, 131)  # B, L, V: V not a multiple of the block
    x = torch.randn(shape, generator=gen) * 3
    if kind == "ties":  # bf16 values: many exact ties, across shards too
        x = x.to(torch.bfloat16).float()
    elif kind == "plateau":
        x = torch.randint(0, 3, shape, generator=gen).float()
    elif kind == "masked":  # -inf tokens (masked), a whole shard of them in one row
        x[torch.rand(shape, generator=gen) < 0.3] = float("-inf")
        x[0, 0, :64] = float("-inf")
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "plateau", "masked"])
@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [1, 7, 32])
def test_sharded_topk_equals_the_whole_vocabulary(kind, shards, k):
    gen = torch.Generator().manual_seed(hash((kind, shards, k)) % 2**31)
    logits = _inputs(kind, gen)
    want_lp, want_ids = logits_to_topk(logits, k, block=BLOCK)
    got_lp, got_ids = _sharded(logits, shards, k)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_lp, want_lp)  # the same float32 bits, normalizer included


def test_default_block_at_a_kimi_like_split():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 8 * 2048 + 5, generator=gen) * 4).to(torch.bfloat16).float()
    want = logits_to_topk(logits, 32)
    got = _sharded(logits, 8, 32, block=2048)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_shards_and_arguments():
    x = torch.randn(2, 40)
    with pytest.raises(ValueError, match="vocab_start"):
        shard_partials(x, 8, 4, block=BLOCK)
    with pytest.raises(ValueError, match="k"):
        shard_partials(x, 0, 0, block=BLOCK)
    with pytest.raises(ValueError, match="shard 0"):
        check_shards([20, 20], block=BLOCK)
    with pytest.raises(ValueError, match="k"):
        merge_partials([shard_partials(x, 0, 4, block=BLOCK)], 5)
    with pytest.raises(ValueError, match="parts"):
        merge_partials([], 1)
