"""The RMSNorm and rotary-embedding kernels against the model's torch ops (the reference), through the
Triton interpreter on the CPU and on CUDA when present: rope bit for bit, RMSNorm to the last bit of its
float32 statistic."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.rmsnorm import rmsnorm
from kdtree_engine.kernels.rope import apply_rope as rope_kernel
from kdtree_engine.model.mla import RMSNorm
from kdtree_engine.model.rope import apply_rope

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 40), (3, 5, 512), (1, 2, 7)])
def test_rmsnorm_kernel_matches_torch(device, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
    norm = RMSNorm(shape[-1], eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
    want = norm(x, impl="ref")
    got = rmsnorm(x, norm.weight, norm.eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
    assert torch.equal(norm(x, impl="triton"), got)


def test_rmsnorm_kernel_on_a_strided_view_and_empty_rows():
    x = torch.randn(4, 2, 96)[:, :, :64]
    w = torch.rand(64)
    ref = RMSNorm(64)
    with torch.no_grad():
        ref.weight.copy_(w)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), ref(x), rtol=1e-6, atol=1e-6)
    assert rmsnorm(torch.empty(0, 3, 64), w, 1e-6).shape == (0, 3, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (1, 1, 16, 64), (3, 2, 64), (1, 4, 1, 16)])
def test_rope_kernel_is_bit_identical(device, dtype, interleave, shape):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    b, t, d = shape[0], shape[1], shape[-1]
    angles = torch.rand(b, t, d // 2, generator=gen) * 100
    cos, sin = angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)
    want = apply_rope(x, cos, sin, interleave)
    assert torch.equal(rope_kernel(x, cos, sin, interleave), want)
    assert torch.equal(apply_rope(x, cos, sin, interleave, impl="triton"), want)
    view = torch.cat([torch.randn(*shape[:-1], 3).to(device=device, dtype=dtype), x], dim=-1)[..., 3:]
    assert torch.equal(rope_kernel(view, cos, sin, interleave), want)  # a non-contiguous input
