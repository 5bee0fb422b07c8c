"""The row-invariant mode of the Triton attention kernel (issue 32), on the CPU through the Triton
interpreter and, marked gpu, at Kimi-K2's shapes on the GPU:

- a tree node's output equals, bit for bit, the output of the same token decoded alone (one new token,
  causal) after its ancestors: the cache then holds the prefix and the node's ancestors in depth order;
- a request's outputs are the same bits alone and batched with requests of other lengths;
- a causal prefill's rows equal the autoregressive steps of the same tokens;
- and the values agree with the reference (ref/mla_attention.py) within the kernels' usual tolerance.

Prefixes cross tile and split boundaries (BLOCK_N 64 in bf16, 32 in float32; splits of 64 positions in
the tests), so the shared prefix tiles, a node's own gathered tiles and the merge of several splits all
take part."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.attention import tree_mla_attention
from kdtree_engine.bench.attention import _tree_visibility
from kdtree_engine.kernels import mla_attention_triton
from kdtree_engine.ref import mla_attention as ref

D_C, D_R = 32, 16
SCALE = (D_C + D_R) ** -0.5


@pytest.fixture(autouse=True)
def _small_splits(monkeypatch):
    """Splits of 64 positions (a multiple of both BLOCK_N): several splits at small prefixes."""
    monkeypatch.setattr(mla_attention_triton, "INVARIANT_CHUNK", 64)


def _attend(q, kv, lengths, visibility=None, invariant=True):
    return tree_mla_attention(
        q,
        kv,
        lengths,
        softmax_scale=SCALE,
        d_v=D_C,
        visibility=visibility,
        impl="triton",
        invariant=invariant,
    )


def _problem(prefixes, t, h, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    b = len(prefixes)
    s_max = max(prefixes) + t + 3
    kv = torch.randn(b, s_max, D_C + D_R, generator=gen).to(dtype).to(device)
    q = torch.randn(b, t, h, D_C + D_R, generator=gen).to(dtype).to(device)
    vis = _tree_visibility(b, t, gen).to(device)
    lengths = torch.tensor([p + t for p in prefixes], device=device)
    return q, kv, vis, lengths


def _autoregressive_step(q, kv, vis, r: int, i: int, prefix: int):
    """Node i of request r decoded alone: the cache holds the prefix, then its ancestors (itself last) in
    index order, and the one new token attends causally."""
    ancestors = vis[r, i].nonzero().flatten()
    rows = torch.cat([kv[r, :prefix], kv[r, prefix + ancestors]])
    cache = torch.cat([rows, torch.zeros_like(kv[r, :3])])[None]  # spare slots past the length
    length = torch.tensor([len(rows)], device=kv.device)
    out, lse = _attend(q[r : r + 1, i : i + 1], cache, length)
    return out[0, 0], lse[0, 0]


CASES = [  # (prefixes, t, h): tree positions cross a 64-position tile / split boundary, or not
    ([70, 5], 9, 4),
    ([60, 130], 7, 8),
    ([0, 64], 5, 16),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, [*c[0], c[1], c[2]])))
def test_tree_rows_equal_their_autoregressive_steps(case, dtype, device):
    prefixes, t, h = case
    q, kv, vis, lengths = _problem(prefixes, t, h, dtype, seed=sum(prefixes) + t, device=device)
    out, lse = _attend(q, kv, lengths, vis)
    for r, prefix in enumerate(prefixes):
        for i in range(t):
            step, step_lse = _autoregressive_step(q, kv, vis, r, i, prefix)
            assert torch.equal(out[r, i], step), f"request {r} node {i}: {(out[r, i] - step).abs().max()}"
            assert torch.equal(lse[r, i], step_lse), f"request {r} node {i}: lse"


def test_paged_cache_gives_the_contiguous_bits(device):
    """The same trees on a paged cache (pages of 16 rows, shuffled): the bits of the contiguous cache,
    so the node's own tiles read their ancestors through the block table."""
    q, kv, vis, lengths = _problem([70, 21], 6, 4, torch.bfloat16, seed=6, device=device)
    b, s_max, d = kv.shape
    pages_per = -(-s_max // 16)
    perm = torch.randperm(b * pages_per, generator=torch.Generator().manual_seed(7))
    table = perm.view(b, pages_per).to(device)
    paged = torch.zeros(b * pages_per, 16, d, dtype=kv.dtype, device=device)
    padded = torch.cat([kv, torch.zeros(b, pages_per * 16 - s_max, d, dtype=kv.dtype, device=device)], 1)
    paged[table.flatten()] = padded.view(b * pages_per, 16, d)
    want = _attend(q, kv, lengths, vis)
    options = dict(softmax_scale=SCALE, d_v=D_C, visibility=vis, impl="triton", invariant=True)
    got = tree_mla_attention(q, paged, lengths, block_table=table, **options)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_node_spread_over_two_row_blocks(device):
    """128 heads: one node's rows fill two 64-row blocks; every node still equals its decoded path."""
    prefixes, t, h = [67], 3, 128
    q, kv, vis, lengths = _problem(prefixes, t, h, torch.bfloat16, seed=8, device=device)
    out, lse = _attend(q, kv, lengths, vis)
    for i in range(t):
        step, step_lse = _autoregressive_step(q, kv, vis, 0, i, prefixes[0])
        assert torch.equal(out[0, i], step) and torch.equal(lse[0, i], step_lse), f"node {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_request_alone_and_in_a_batch_gets_the_same_bits(dtype, device):
    q, kv, vis, lengths = _problem([130, 3, 66], 6, 8, dtype, seed=1, device=device)
    out, lse = _attend(q, kv, lengths, vis)
    for r in range(3):
        alone, alone_lse = _attend(q[r : r + 1], kv[r : r + 1], lengths[r : r + 1], vis[r : r + 1])
        assert torch.equal(alone[0], out[r]) and torch.equal(alone_lse[0], lse[r])


def test_prefill_rows_equal_their_autoregressive_steps(device):
    """A causal prefill of 80 tokens (over no prefix) and the steps that decode its tokens one by one."""
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(1, 83, D_C + D_R, generator=gen).bfloat16().to(device)
    q = torch.randn(1, 80, 4, D_C + D_R, generator=gen).bfloat16().to(device)
    out, _ = _attend(q, kv, torch.tensor([80], device=device))
    for i in (0, 1, 31, 63, 64, 79):
        step, _ = _attend(q[:, i : i + 1], kv, torch.tensor([i + 1], device=device))
        assert torch.equal(out[0, i], step[0, 0]), f"token {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_values_match_the_reference(dtype, device):
    q, kv, vis, lengths = _problem([70, 5, 130], 9, 4, dtype, seed=3, device=device)
    got, got_lse = _attend(q, kv, lengths, vis)
    want, want_lse = ref.tree_mla_attention(q.double(), kv.double(), lengths, vis, SCALE, D_C)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-3, atol=1e-3)


def test_ancestor_bits_give_the_visibility_result(device):
    q, kv, vis, lengths = _problem([70, 5], 9, 4, torch.bfloat16, seed=4, device=device)
    bits = (vis.long() << torch.arange(9, device=device)).sum(-1)
    with_bits = tree_mla_attention(
        q, kv, lengths, softmax_scale=SCALE, d_v=D_C, ancestor_bits=bits, impl="triton", invariant=True
    )
    assert torch.equal(with_bits[0], _attend(q, kv, lengths, vis)[0])


def test_ancestor_slots_list_each_nodes_path():
    from kdtree_engine.kernels.mla_attention_args import Mask, Problem

    vis = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], dtype=torch.bool)
    bits = (vis.long() << torch.arange(4)).sum(-1)
    lengths = torch.tensor([4])
    want = [[[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 2, 3, -1]]]
    for mask in (Mask.make(vis, None, lengths), Mask.make(None, bits, lengths)):
        problem = Problem(1, 4, 1, 8, 4, 1.0, lengths, mask, None)
        assert mla_attention_triton.ancestor_slots(problem).tolist() == want
    assert (
        mla_attention_triton.ancestor_slots(
            Problem(1, 4, 1, 8, 4, 1.0, lengths, Mask.make(None, None, lengths), None)
        )
        is None
    )


def test_invariant_mode_refuses_forced_splits():
    q, kv, vis, lengths = _problem([10], 2, 1, torch.float32, seed=5, device="cpu")
    with pytest.raises(ValueError, match="num_splits"):
        tree_mla_attention(
            q, kv, lengths, softmax_scale=SCALE, d_v=D_C, impl="triton", invariant=True, num_splits=2
        )


@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 64])
def test_kimi_shapes_on_the_gpu(h, monkeypatch):
    """bf16 at Kimi-K2's widths (512 + 64) with the default split of 1024 positions: trees of 33 nodes
    on prefixes around a split boundary, their autoregressive steps, alone and batched."""
    monkeypatch.setattr(mla_attention_triton, "INVARIANT_CHUNK", 1024)
    gen = torch.Generator().manual_seed(h)
    prefixes, t, d = [1000, 2050, 37], 33, 576
    kv = torch.randn(3, 2100, d, generator=gen).bfloat16().cuda()
    q = torch.randn(3, t, h, d, generator=gen).bfloat16().cuda()
    vis = _tree_visibility(3, t, gen).cuda()
    lengths = torch.tensor([p + t for p in prefixes], device="cuda")
    out, _ = tree_mla_attention(
        q, kv, lengths, softmax_scale=192**-0.5, d_v=512, visibility=vis, invariant=True
    )
    for r, prefix in enumerate(prefixes):
        for i in (0, 1, t // 2, t - 1):
            ancestors = vis[r, i].nonzero().flatten()
            rows = torch.cat([kv[r, :prefix], kv[r, prefix + ancestors]])[None]
            length = torch.tensor([rows.shape[1]], device="cuda")
            step, _ = tree_mla_attention(
                q[r : r + 1, i : i + 1], rows, length, softmax_scale=192**-0.5, d_v=512, invariant=True
            )
            assert torch.equal(out[r, i], step[0, 0]), f"request {r} node {i}"
