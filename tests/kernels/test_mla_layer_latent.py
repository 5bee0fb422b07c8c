"""The MLA latent row write (kernels/mla_latent.py) against its reference (ref/mla_latent.py) and
against the kernel path it replaces (RMSNorm kernel + rope kernel + cat + index_put): bit for bit with
the latter; with the reference, the roped k_pe bit for bit and c_kv to the last bit of the float32
statistic. Rows the write must not touch stay NaN."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.mla_latent import latent_write
from kdtree_engine.kernels.rmsnorm import rmsnorm
from kdtree_engine.kernels.rope import apply_rope
from kdtree_engine.ref.mla_latent import latent_write as latent_write_ref

R, D_R = 64, 16


def _inputs(b, t, start, max_len, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    kv_a = (torch.randn(b, t, R + D_R + 5, generator=gen) * 2).to(device=device, dtype=dtype)[..., :-5]
    weight = (1 + 0.1 * torch.randn(R, generator=gen)).to(device=device, dtype=dtype)
    angles = torch.rand(b, t, D_R // 2, generator=gen) * 100
    cos, sin = (angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype))
    kv = torch.full((b, max_len, R + D_R), float("nan"), dtype=dtype, device=device)
    return kv_a, weight, cos, sin, kv, torch.tensor(start, device=device)


CASES = [(1, 1, [0], 1), (1, 1, [6], 7), (1, 33, [0], 33), (3, 33, [5, 0, 14], 47), (2, 4, [3, 9], 13)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("b,t,start,max_len", CASES)
def test_latent_write_matches_the_kernel_path_and_the_reference(
    device, dtype, interleave, b, t, start, max_len
):
    kv_a, w, cos, sin, kv, st = _inputs(b, t, start, max_len, dtype, device, seed=b * 100 + t)
    got, want, ref = kv.clone(), kv.clone(), kv.clone()
    latent_write(kv_a, w, 1e-6, cos, sin, interleave, got, st)
    latent_write_ref(kv_a, w, 1e-6, cos, sin, interleave, ref, st)
    c_kv, k_pe = kv_a.split([R, D_R], dim=-1)  # the kernel path it replaces
    rows = torch.cat([rmsnorm(c_kv, w, 1e-6), apply_rope(k_pe, cos, sin, interleave)], dim=-1)
    want[torch.arange(b, device=device)[:, None], st[:, None] + torch.arange(t, device=device)] = rows
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isnan(), ref.isnan())
    assert int((~got.isnan()).all(-1).sum()) == b * t  # exactly the b * t new rows written
    written = ~got.isnan()
    assert torch.equal(got[written], want[written])
    assert torch.equal(got[..., R:][written[..., R:]], ref[..., R:][written[..., R:]])  # rope: exact
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    err = (got[..., :R] - ref[..., :R]).float().abs().nan_to_num().max()
    assert err <= tol * 8, f"c_kv worst |kernel - ref| = {err}"


def test_latent_write_casts_to_the_cache_dtype(device):
    kv_a, w, cos, sin, kv, st = _inputs(2, 3, [1, 4], 9, torch.float32, device, seed=7)
    got = kv.to(torch.bfloat16)
    ref = got.clone()
    latent_write(kv_a, w, 1e-6, cos, sin, False, got, st)
    latent_write_ref(kv_a, w, 1e-6, cos, sin, False, ref, st)
    assert torch.equal(got[..., R:].isnan(), ref[..., R:].isnan())
    assert torch.equal(got[..., R:].nan_to_num(), ref[..., R:].nan_to_num())
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_reference_is_the_model_reference_path(dtype):
    from kdtree_engine.model.mla import RMSNorm
    from kdtree_engine.model.rope import apply_rope as rope_ref

    kv_a, w, cos, sin, kv, st = _inputs(3, 5, [0, 2, 7], 12, dtype, "cpu", seed=11)
    norm = RMSNorm(R).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    want, got = kv.clone(), kv.clone()
    latent_write_ref(kv_a, w, 1e-6, cos, sin, True, got, st)
    rows = torch.cat([norm(kv_a[..., :R]), rope_ref(kv_a[..., R:], cos, sin, True)], dim=-1)
    want[torch.arange(3)[:, None], st[:, None] + torch.arange(5)] = rows
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
