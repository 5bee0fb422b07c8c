"""The LSE merge of split-KV partials (kernels.mla_attention_merge.merge_splits) against torch's
logsumexp, with more splits than one round of loads takes, empty splits whose partial holds NaN, and
rows no split saw. CPU: the Triton interpreter (4 splits per round); GPU: the launch a CUDA call uses
(MERGE_SPLITS)."""

import pytest
import torch

from kdtree_engine.kernels.mla_attention_merge import merge_splits


def _inputs(b, splits, rows, d_c, gen):
    part = torch.randn(b, splits, rows, d_c, generator=gen)
    plse = torch.randn(b, splits, rows, generator=gen) * 4
    empty = torch.rand(b, splits, rows, generator=gen) < 0.3  # splits that saw no slot of the row
    plse[empty] = float("-inf")
    part[empty] = float("nan")  # never read into the sum: its weight is 0
    plse[0, :, 0] = float("-inf")  # a row no split saw: out 0, lse -inf
    part[0, :, 0] = float("nan")
    return part, plse


def _want(part, plse):
    lse = torch.logsumexp(plse, dim=1)  # [b, rows]
    w = torch.exp(plse - torch.where(lse.isinf(), 0.0, lse)[:, None])
    out = (w[..., None] * part.nan_to_num(0.0)).sum(1)
    return out, lse


def _run(part, plse, rows, d_c):
    b, splits = part.shape[:2]
    out = torch.empty(b, rows, d_c, device=part.device)
    lse = torch.empty(b, rows, device=part.device)
    merge_splits(part, plse, out, lse)
    return out, lse


@pytest.mark.parametrize("splits,rows,d_c", [(1, 5, 24), (3, 16, 32), (4, 17, 24), (11, 9, 32), (64, 3, 8)])
def test_merge_matches_logsumexp(splits, rows, d_c, device):
    gen = torch.Generator().manual_seed(splits * 31 + rows)
    part, plse = _inputs(2, splits, rows, d_c, gen)
    got_out, got_lse = (x.cpu() for x in _run(part.to(device), plse.to(device), rows, d_c))
    want_out, want_lse = _want(part, plse)
    assert torch.equal(got_lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_out[0, 0], torch.zeros(d_c))  # the row no split saw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 2, 7, 8, 9, 33, 128, 131])
@pytest.mark.parametrize("rows", [8, 72])
def test_merge_matches_logsumexp_gpu(splits, rows):
    gen = torch.Generator().manual_seed(splits * 7 + rows)
    part, plse = _inputs(3, splits, rows, 512, gen)
    got_out, got_lse = _run(part.cuda(), plse.cuda(), rows, 512)
    want_out, want_lse = _want(part.double(), plse.double())
    assert torch.equal(got_lse.isinf().cpu(), want_lse.isinf())
    torch.testing.assert_close(got_lse.cpu(), want_lse.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out.cpu(), want_out.float(), rtol=1e-5, atol=1e-5)
