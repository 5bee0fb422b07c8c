"""bench/flashmla.py on the CPU, with a stand-in for the flash_mla module that computes what its dense
decode computes (our reference over its paged cache; lse laid out [b, h, t] as FlashMLA returns it):
the cache views FlashMLA reads, the lse merge, and the cascade (prefix by FlashMLA, tree by ours)
equal to our reference tree attention. The real module runs on the H200 only (`bench attention`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdtree_engine.bench import flashmla
from kdtree_engine.ref import mla_attention as ref

D, D_V = 40, 32


def _stand_in() -> SimpleNamespace:
    calls = []

    def with_kvcache(q, pages, block_table, seqlens, d_v, meta, *, softmax_scale, causal, use_legacy):
        assert use_legacy and pages.shape[1:3] == (flashmla.PAGE, 1) and block_table.dtype == torch.int32
        b, t = q.shape[:2]
        full = torch.ones(b, t, t, dtype=torch.bool)
        vis = torch.tril(full) if causal else full
        out, lse = ref.tree_mla_attention(q, pages[:, :, 0], seqlens, vis, softmax_scale, d_v, block_table)
        calls.append(causal)
        return out.to(q.dtype), lse.transpose(1, 2)

    return SimpleNamespace(get_mla_metadata=lambda: (object(), None), flash_mla_with_kvcache=with_kvcache,
                           calls=calls)  # fmt: skip


def _problem(b=3, t=5, h=2, s_max=128, paged=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, D, generator=gen)
    kv = torch.randn(b, s_max, D, generator=gen)
    lengths = torch.tensor([s_max, 70, 2 * t][:b])
    vis = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
    for i in range(1, t):
        parent = torch.randint(0, i, (b,), generator=gen)
        vis[:, i] |= vis[torch.arange(b), parent]
    table = None
    if paged:
        pages = s_max // flashmla.PAGE
        order = torch.randperm(b * pages, generator=gen)
        store = torch.empty(b * pages, flashmla.PAGE, D)
        store[order] = kv.view(b * pages, flashmla.PAGE, D)
        kv, table = store, order.view(b, pages)
    return q, kv, lengths, vis, table


@pytest.mark.parametrize("paged", [False, True])
def test_cascade_equals_the_reference_tree_attention(paged):
    module = _stand_in()
    q, kv, lengths, vis, table = _problem(paged=paged)
    cascade = flashmla.cascade_call(module, q, kv, lengths, table, vis, 0.3, D_V, impl="ref")
    out, lse = cascade()
    want, want_lse = ref.tree_mla_attention(q, kv, lengths, vis, 0.3, D_V, table)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert module.calls == [False, False]  # the prefix pass, unmasked: once when built, once now


def test_causal_call_is_a_chain_mask_over_the_last_rows():
    module = _stand_in()
    q, kv, lengths, _, table = _problem(paged=True, seed=1)
    out, lse = flashmla.causal_call(module, q, kv, lengths, table, 0.2, D_V)()
    chain = torch.tril(torch.ones(3, 5, 5, dtype=torch.bool))
    want, want_lse = ref.tree_mla_attention(q, kv, lengths, chain, 0.2, D_V, table)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_merge_by_lse_is_attention_over_the_union():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 4, 10, generator=gen)  # [b, t, h, keys]
    values = torch.randn(10, 6, generator=gen)

    def attend(cols):
        s = scores[..., cols]
        return torch.softmax(s, -1) @ values[cols], torch.logsumexp(s, -1)

    out, lse = flashmla.merge_by_lse(*attend(slice(0, 7)), *attend(slice(7, 10)))
    want, want_lse = attend(slice(0, 10))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_pages_flashmla_cannot_read_are_refused():
    kv = torch.zeros(4, 32, D)
    with pytest.raises(ValueError, match="pages of 64 rows"):
        flashmla.as_pages(kv, torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="not a multiple"):
        flashmla.as_pages(torch.zeros(2, 100, D), None)
    pages, table = flashmla.as_pages(torch.zeros(2, 128, D), None)
    assert pages.shape == (4, 64, 1, D) and table.tolist() == [[0, 1], [2, 3]]


@pytest.mark.gpu
@pytest.mark.parametrize("h,t,page", [(64, 9, 64), (8, 33, 0), (128, 4, 64)])
def test_gpu_flashmla_causal_and_cascade_equal_ours(h, t, page):
    """The real FlashMLA (where flash_mla imports: the H200 with the carried wheel) on Kimi dims, bf16:
    its causal decode equals ours with a causal mask, and the cascade ours with the tree mask, within
    bf16 tolerance."""
    from kdtree_engine.attention import tree_mla_attention
    from kdtree_engine.bench.attention import D_C, make_problem

    module = flashmla.load()
    if module is None:
        pytest.skip("flash_mla is not installed (bench/flashmla.py: a wheel carried to the GPU machine)")
    p = make_problem(3, t, h, 1024, page, torch.device("cuda"), seed=1)
    scale = 192**-0.5
    args = (p["q"], p["kv"], p["lengths"], p["block_table"])
    want_causal, _ = tree_mla_attention(*args[:3], softmax_scale=scale, d_v=D_C, block_table=p["block_table"])
    want_tree, _ = tree_mla_attention(*args[:3], softmax_scale=scale, d_v=D_C, block_table=p["block_table"],
                                      visibility=p["vis"])  # fmt: skip
    got_causal, _ = flashmla.causal_call(module, *args, scale, D_C)()
    got_tree, _ = flashmla.cascade_call(module, *args, p["vis"], scale, D_C)()
    torch.testing.assert_close(got_causal.float(), want_causal.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_tree.float(), want_tree.float(), rtol=2e-2, atol=2e-2)
