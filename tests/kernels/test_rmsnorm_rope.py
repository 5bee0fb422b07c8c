"""The RMSNorm and rotary-embedding kernels against the model's torch ops (the reference), through the
Triton interpreter on the CPU and on CUDA when present: rope bit for bit, RMSNorm to the last bit of its
float32 statistic."""

from __future__ import annotations

import os

import pytest
import torch

from kdtree_engine.kernels.rmsnorm import add_rmsnorm, rmsnorm
from kdtree_engine.kernels.rope import apply_rope as rope_kernel
from kdtree_engine.model.mla import RMSNorm
from kdtree_engine.model.rope import apply_rope

# CPU tensors reach the Triton kernels only through the interpreter (on a CUDA machine the kernels need
# CUDA tensors): the CPU case runs where the interpreter is on (CI), the CUDA case where there is a GPU.
DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
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


def test_rmsnorm_kernel_on_a_strided_view_and_empty_rows(device):
    x = torch.randn(4, 2, 96, device=device)[:, :, :64]
    w = torch.rand(64, device=device)
    ref = RMSNorm(64).to(device)
    with torch.no_grad():
        ref.weight.copy_(w)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), ref(x), rtol=1e-6, atol=1e-6)
    assert rmsnorm(torch.empty(0, 3, 64, device=device), w, 1e-6).shape == (0, 3, 64)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 33, 40), (3, 5, 512)])
def test_add_rmsnorm_kernel_equals_add_then_the_rmsnorm_kernel(device, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x, delta = ((torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype) for _ in range(2))
    norm = RMSNorm(shape[-1], eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
    total, normed = add_rmsnorm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)  # the add rounds as torch's
    assert torch.equal(normed, rmsnorm(x + delta, norm.weight, norm.eps))
    want_total, want = norm.add_norm(x, delta, impl="ref")
    assert torch.equal(total, want_total)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(normed.float(), want.float(), rtol=ulp, atol=ulp)
    got = norm.add_norm(x[:, :1].expand(shape), delta, impl="triton")  # a stride-0 input
    assert torch.equal(got[1], rmsnorm(x[:, :1] + delta, norm.weight, norm.eps))


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_kernel_writes_a_strided_destination(device, interleave):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, 24, generator=gen).to(device)  # [b, t, h, d_nope 8 + d_r 16]
    angles = torch.rand(2, 3, 8, generator=gen) * 100
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    buf = torch.full((2, 3, 4, 40), float("nan"), device=device)
    rope_kernel(q[..., 8:], cos, sin, interleave, out=buf[..., 24:])
    assert torch.equal(buf[..., 24:], apply_rope(q[..., 8:], cos, sin, interleave))
    assert buf[..., :24].isnan().all()
