"""The worker's draft top-k step: one rank and several (threads standing in for tensor-parallel ranks)
give logits_to_topk of the whole vocabulary, bit for bit; the method wrapper reads SGLang's lm_head."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from kdtree_engine.integrations.sglang import topk as T
from kdtree_engine.ref import tree as ref_tree
from tests.integrations.thread_group import ThreadGroup


def inputs(seed: int, tokens: int, vocab: int, ties: bool):
    """Quarter-integer entries: every matmul sum is exact, so no thread count or order changes a logit."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-8, 9, (tokens, 16), generator=g) / 4
    w = torch.randint(-8, 9, (vocab, 16), generator=g) / 4
    if ties:  # few distinct rows: equal logits across shards
        w = w[torch.randint(0, 5, (vocab,), generator=g)]
    return h, w


def run_ranks(h, w, topk, world):
    group, shard = ThreadGroup(world), w.shape[0] // world
    results = [None] * world

    def rank(r):
        group.local.rank = r
        results[r] = T.draft_topk(h, w[r * shard : (r + 1) * shard], topk, vocab_start=r * shard, group=group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("topk", [1, 8, 33])
def test_one_rank_is_logits_to_topk(ties, topk):
    h, w = inputs(topk, 7, 300, ties)
    lp, ids = T.draft_topk(h, w, topk)
    want_lp, want_ids = ref_tree.logits_to_topk((h @ w.t()).unsqueeze(0), topk)
    assert torch.equal(lp, want_lp[0]) and torch.equal(ids, want_ids[0])


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_ranks_merge_to_the_whole_vocabulary(world, ties, device):
    """On CUDA every rank runs the fused kernel (shard mode, or whole-vocabulary for one rank)."""
    h, w = inputs(world, 5, 8 * 2048, ties)
    want_lp, want_ids = ref_tree.logits_to_topk((h @ w.t()).unsqueeze(0), 32)
    for lp, ids in run_ranks(h.to(device), w.to(device), 32, world):
        assert torch.equal(ids.cpu(), want_ids[0]) and torch.equal(lp.cpu(), want_lp[0])


def test_topk_larger_than_the_vocabulary_pads_like_the_port():
    h, w = inputs(0, 3, 5, False)
    lp, ids = T.draft_topk(h, w, 8)
    assert torch.isinf(lp[:, 5:]).all() and (ids[:, 5:] == 0).all() and torch.isfinite(lp[:, :5]).all()


def test_misaligned_shard_is_refused():
    h, w = inputs(0, 2, 4096, False)
    with pytest.raises(ValueError, match="vocab_start"):
        T.draft_topk(h, w, 4, vocab_start=100, group=types.SimpleNamespace(world_size=2))


def test_method_reads_the_lm_head(monkeypatch):
    """Single rank: the worker method equals the port's formula on inputs without ties (ids equal,
    log-probs within float32 rounding of the port's logsumexp)."""
    group = types.SimpleNamespace(world_size=1)
    dist = types.ModuleType("sglang.srt.distributed")
    dist.get_tp_group = lambda: group
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", dist)
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(6, 16, generator=g), torch.randn(1000, 16, generator=g)
    shard = types.SimpleNamespace(num_org_elements=1000, num_org_elements_padded=1024, num_added_elements=0,
                                  org_vocab_start_index=0, added_vocab_start_index=1024)  # fmt: skip
    lm_head = types.SimpleNamespace(shard_indices=shard, weight=torch.cat([w, torch.zeros(24, 16)]))
    lp, ids = T.compute_draft_topk_log_probs_and_token_ids(None, h, lm_head, 16)
    logits = (h @ w.t()).float()
    port_vals, port_ids = torch.topk(logits, 16, dim=-1)
    port_lp = port_vals - torch.logsumexp(logits, dim=-1, keepdim=True)
    assert torch.equal(ids, port_ids)
    torch.testing.assert_close(lp, port_lp, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="topk"):
        T.compute_draft_topk_log_probs_and_token_ids(None, h, lm_head, 0)
    shard.num_added_elements = 3
    with pytest.raises(ValueError, match="lm_head"):
        T.compute_draft_topk_log_probs_and_token_ids(None, h, lm_head, 4)


@pytest.mark.parametrize("vocab, k, ties", [(300, 8, True), (2148, 5, False), (2148, 16, True)])
def test_shard_kernel_equals_reference(vocab, k, ties, device):
    """The fused top-k's raw mode: the shard's logits and block partials, as the reference's."""
    from kdtree_engine.kernels.tree_topk import shard_topk

    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(2, 3, vocab, generator=g) * 3
    x = torch.round(x) if ties else x
    values, ids, bmax, bsum = shard_topk(x.to(device), k)
    want_values, want_ids = ref_tree.topk_stable(x, k)
    want_max, want_sum = ref_tree.block_partials(x.reshape(6, vocab))
    assert torch.equal(values.cpu(), want_values) and torch.equal(ids.cpu(), want_ids)
    assert torch.equal(bmax.cpu(), want_max) and torch.equal(bsum.cpu(), want_sum)
