"""kernels/sglang_attention.verify_metadata (one launch) against its reference
ref/sglang_attention.verify_metadata, on fresh random inputs: exact equality (every output is discrete).
Cases: page sizes 1, 16 and 64; block tables cut at a host bound and as wide as req_to_token; trees of
1, 2, 33 and 64 nodes (bit 63, the sign bit); a visibility holding fewer requests than the batch (the
padding of a replayed graph) and wider than [t, t]; no tree (decode, t = 0); an empty batch; outputs
that are views of wider static buffers; tables of several programs' column chunks. A request's table
columns past its last page are the attention's to ignore: the kernel leaves them unwritten, which the
test checks against the buffers' fill value. On the CPU through the Triton interpreter, on CUDA compiled."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels import sglang_attention as kernel
from kdtree_engine.ref import sglang_attention as ref


def _inputs(bs, t, page, width, reqs, gen, nv=None):
    """seq_lens, req_pool_indices (distinct rows), req_to_token (page-aligned rows: the first token of a
    page a multiple of page), visibility [nv, t, t] (random, diagonal set) or None."""
    seq_lens = torch.randint(0, width - t + 1, (bs,), generator=gen)
    pool_idx = torch.randperm(reqs, generator=gen)[:bs]
    pages = torch.randint(0, 10_000, (reqs, -(-width // page)), generator=gen, dtype=torch.int32)
    r2t = (pages * page).repeat_interleave(page, dim=1)[:, :width] + torch.arange(
        width, dtype=torch.int32
    ) % page
    vis = None
    if t:
        nv = bs if nv is None else nv
        full = torch.rand(nv, t + 3, 2 * t + 2, generator=gen) < 0.5  # wider than [t, t], as the port's
        full[:, torch.arange(t), torch.arange(t)] = True
        vis = full
    return seq_lens, pool_idx, r2t, vis


def _run_kernel(device, seq_lens, pool_idx, r2t, vis, t, page, cols, wide=False):
    bs = seq_lens.shape[0]
    extra = 5 if wide else 0  # outputs as heads of larger static buffers
    seqlens = torch.full((bs + extra,), -7, dtype=torch.int32, device=device)[:bs]
    table = torch.full((bs + extra, cols + extra), -7, dtype=torch.int32, device=device)[:bs, :cols]
    bits = None
    if vis is not None and t <= ref.MAX_BITS:
        bits = torch.full((bs * t + extra,), -7, dtype=torch.int64, device=device)[: bs * t].view(bs, t)
    args = [x.to(device) if x is not None else None for x in (seq_lens, pool_idx, r2t, vis)]
    kernel.verify_metadata(*args, t, page, seqlens, table, bits)
    return seqlens.cpu(), table.cpu(), None if bits is None else bits.cpu()


CASES = [  # (bs, t, page, width, nv, cut, wide)
    (3, 9, 1, 300, None, True, False),
    (4, 33, 1, 500, 2, False, True),  # padded requests see only themselves
    (2, 64, 16, 700, None, True, False),  # bit 63
    (5, 1, 64, 1000, None, False, True),
    (1, 2, 64, 129, None, True, False),
    (6, 0, 16, 257, None, True, True),  # decode: no tree
    (3, 17, 1, 3000, 0, True, False),  # no visibility rows at all: every request padded
    (4, 9, 1, 2500, None, False, True),  # three column chunks, most requests' last ones unread
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_metadata_kernel_equals_reference(device, case, seed):
    bs, t, page, width, nv, cut, wide = case
    gen = torch.Generator().manual_seed(seed * 100 + t)
    seq_lens, pool_idx, r2t, vis = _inputs(bs, t, page, width, 2 * bs + 3, gen, nv)
    pages = -(-width // page)
    bound = int(seq_lens.max()) + t
    cols = min(pages, -(-bound // page)) if cut else pages
    want = ref.verify_metadata(seq_lens, pool_idx, r2t, vis, t, page, cols)
    got = _run_kernel(device, seq_lens, pool_idx, r2t, vis, t, page, cols, wide)
    used = torch.arange(cols)[None, :] < -(-(seq_lens[:, None] + t) // page)  # the pages each request reaches
    assert torch.equal(torch.where(used, got[1], -7), torch.where(used, want[1], -7)), "block_table"
    assert bool((got[1][~used] == -7).all()), "block_table: columns past a request's pages were written"
    for name, g, w in zip(("seqlens", "bits"), got[::2], want[::2]):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_reference_block_table_and_bits_by_hand():
    """The reference itself, on a case written out: pages of 2, a two-node tree, one padded request."""
    r2t = torch.tensor([[8, 9, 4, 5, 0, 1], [2, 3, 6, 7, 10, 11]], dtype=torch.int32)
    vis = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    seqlens, table, bits = ref.verify_metadata(torch.tensor([3, 1]), torch.tensor([1, 0]), r2t, vis, 2, 2, 2)
    assert seqlens.tolist() == [5, 3]
    assert table.tolist() == [[1, 3], [4, 2]]
    assert bits.tolist() == [[0b01, 0b11], [0b01, 0b10]]


def test_empty_batch_launches_nothing(device):
    seqlens = torch.empty(0, dtype=torch.int32, device=device)
    table = torch.empty(0, 4, dtype=torch.int32, device=device)
    r2t = torch.zeros(2, 4, dtype=torch.int32, device=device)
    idx = torch.empty(0, dtype=torch.int64, device=device)
    kernel.verify_metadata(idx, idx, r2t, None, 0, 1, seqlens, table, None)
