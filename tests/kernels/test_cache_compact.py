"""The cache compaction after a verify forward in one launch (kernels.cache_compact) against its
reference (ref.cache_compact, the gather-then-scatter the cache used to run) on fresh random caches:
accepted paths of a tree (increasing, -1 padded), a done request (nothing kept), a root alone, a keep that
is not increasing (a permutation: every read before any write), rows clamped at the cache's end, latent
widths that are not a multiple of the column block (kimi-nano's 80, Kimi's 576). The cache and the
lengths exactly equal (a copy); on CUDA against the CPU reference; bf16 and float32."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.cache_compact import compact_rows
from kdtree_engine.model.cache import LatentKVCache
from kdtree_engine.ref.cache_compact import compact_rows as ref_compact_rows


def _case(seed: int, b: int, k: int, d: int, max_len: int, layers: int = 3, dtype=torch.float32):
    """kv [layers, b, max_len, d] random; per request a start, an accepted path of the tree's node
    indices (root 0 first, increasing) and its length, -1 past it."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, b, max_len, d, generator=gen).to(dtype)
    start = torch.randint(0, max_len - 2 * k, (b,), generator=gen)
    keep = torch.full((b, k), -1, dtype=torch.int64)
    keep_len = torch.randint(1, k + 1, (b,), generator=gen)
    for r in range(b):
        n = int(keep_len[r])
        rest = torch.randperm(2 * k - 1, generator=gen)[: n - 1] + 1  # node indices after the root
        keep[r, :n] = torch.cat([torch.zeros(1, dtype=torch.int64), rest.sort().values])
    return kv, start, keep, keep_len


def _both(kv, start, keep, keep_len, device):
    """(kernel's kv, seqlens) on `device`, (reference's) on the CPU."""
    want_kv, want_len = kv.clone(), torch.zeros(kv.shape[1], dtype=torch.int64)
    ref_compact_rows(want_kv, want_len, start, keep, keep_len)
    got_kv, got_len = kv.clone().to(device), torch.zeros(kv.shape[1], dtype=torch.int64, device=device)
    compact_rows(got_kv, got_len, start.to(device), keep.to(device), keep_len.to(device))
    return (got_kv.cpu(), got_len.cpu()), (want_kv, want_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,k,d", [(1, 1, 80), (2, 9, 80), (3, 17, 64), (2, 33, 576), (2, 65, 96)])
def test_kernel_equals_reference_on_accepted_paths(device, b, k, d, dtype):
    kv, start, keep, keep_len = _case(b * 100 + k, b, k, d, max_len=4 * k + 8, dtype=dtype)
    got, want = _both(kv, start, keep, keep_len, device)
    assert torch.equal(got[1], want[1]) and torch.equal(got[1], start + keep_len)
    assert torch.equal(got[0], want[0])
    moved = kv.clone()
    for r in range(b):  # what the move means, spelled out
        for i in range(int(keep_len[r])):
            moved[:, r, start[r] + i] = kv[:, r, start[r] + keep[r, i]]
    assert torch.equal(got[0], moved)


def test_done_requests_a_root_alone_and_a_permutation(device):
    """keep_len 0 (a done request: nothing moves, its length stays start), a root alone, and a keep
    that is not increasing (rows swapped: every kept row read before any is written)."""
    kv, start, _, _ = _case(7, 3, 5, 80, max_len=40)
    keep = torch.tensor([[3, -1, -1, -1, -1], [0, -1, -1, -1, -1], [4, 2, 0, 3, 1]])
    keep_len = torch.tensor([0, 1, 5])
    got, want = _both(kv, start, keep, keep_len, device)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][:, 0], kv[:, 0]) and torch.equal(got[0][:, 1], kv[:, 1])
    assert torch.equal(got[0][:, 2, start[2] : start[2] + 5], kv[:, 2, start[2] + keep[2]])


def test_rows_past_the_cache_are_clamped_as_the_reference_clamps_them(device):
    """validate=False: a start near the cache's end sends rows past it to its last row in both."""
    kv, _, _, _ = _case(9, 2, 4, 80, max_len=12)
    start = torch.tensor([9, 2])
    keep = torch.tensor([[0, 1, -1, -1], [0, 2, 3, -1]])
    keep_len = torch.tensor([2, 3])
    got, want = _both(kv, start, keep, keep_len, device)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_cache_runs_the_kernel_for_a_kernel_impl(device, monkeypatch):
    """LatentKVCache.compact: impl "ref" runs the reference, a kernel impl (or None on CUDA) the kernel;
    the same cache either way."""
    from kdtree_engine.kernels import cache_compact

    calls = []
    real = cache_compact.compact_rows
    monkeypatch.setattr(cache_compact, "compact_rows", lambda *a: calls.append(1) or real(*a))
    kv, start, keep, keep_len = _case(11, 2, 9, 80, max_len=44)
    caches = {impl: LatentKVCache(kv.clone().to(device)) for impl in ("ref", "triton")}
    for impl, cache in caches.items():
        cache.compact(start.to(device), keep.to(device), keep_len.to(device), validate=False, impl=impl)
    assert calls == [1]
    assert torch.equal(caches["ref"].kv, caches["triton"].kv)
    assert torch.equal(caches["ref"].seqlens, caches["triton"].seqlens)
