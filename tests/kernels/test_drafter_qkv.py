"""The drafter's q/k RMSNorm + rope (+ context-cache write) kernels (kernels/drafter_qkv.py) against
their float32 reference (ref/drafter_qkv.py), and the reference against the drafter's torch modules
(q_norm / k_norm, rope_cos_sin, apply_rope) on the split projections.

Tolerances: float32 1e-5; bf16 / fp16 one rounding of the output (the kernel's cos / sin and the
reference's may differ in their last float32 bit, and the torch modules round after every product)."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_drafter_attention import assert_close

from kdtree_engine.drafter.model import apply_rope, rope_cos_sin
from kdtree_engine.kernels import drafter_qkv as kernels
from kdtree_engine.model.mla import RMSNorm
from kdtree_engine.ref import drafter_qkv as ref

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
THETA = 1_000_000.0


def inv_freq(d: int, device) -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, d, 2, device=device).float() / d)


def norms(d: int, dtype, device, gen, layers: int | None = None) -> torch.Tensor:
    shape = (d,) if layers is None else (layers, d)
    return (1 + 0.2 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b, t, h, g, d", [(2, 16, 8, 4, 32), (1, 1, 4, 4, 32), (3, 5, 8, 2, 24), (1, 16, 2, 1, 64)]
)
def test_block_kernel_matches_reference(device, dtype, b, t, h, g, d):
    gen = torch.Generator().manual_seed(b + t + h + d)
    qkv = (3 * torch.randn(b, t, h + 2 * g, d, generator=gen)).to(device=device, dtype=dtype)
    qw, kw = norms(d, dtype, device, gen), norms(d, dtype, device, gen)
    start = torch.randint(0, 5000, (b,), generator=gen).to(device)
    args = (qw, kw, start, inv_freq(d, device), 1e-6, h)
    want = ref.block_qkv(qkv.clone(), *args)
    buf = qkv.clone()
    got = kernels.block_qkv(buf, *args)
    for name, x, y in zip("qkv", got, want):
        assert x.shape == y.shape and x.dtype == dtype
        assert x.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), f"{name}: not a view"
        assert_close(name, x, y, TOL[dtype])
    assert torch.equal(got[2], qkv[:, :, h + g :])  # values untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, c, n, h, g, d", [(2, 4, 3, 8, 4, 32), (1, 1, 1, 4, 4, 16), (3, 16, 2, 8, 2, 24)])
def test_context_kernel_matches_reference(device, dtype, b, c, n, h, g, d):
    gen = torch.Generator().manual_seed(b + c + n + d)
    s = 40
    qkv = torch.randn(b, c, n, h + 2 * g, d, generator=gen).to(device=device, dtype=dtype)
    kw = norms(d, dtype, device, gen, layers=n)
    seqlens = torch.tensor([0, s - c - 1, s - 2][:b], device=device)  # the last request reaches the clamp
    caches = [torch.full((n, b, s, g, d), float("nan"), device=device, dtype=dtype) for _ in range(4)]
    args = (kw, seqlens, inv_freq(d, device), 1e-6, h)
    ref.context_kv_write(qkv, *args, caches[0], caches[1])
    kernels.context_kv_write(qkv, *args, caches[2], caches[3])
    for r in range(b):  # the rows written below the last slot (clamped rows overwrite each other there)
        rows = slice(int(seqlens[r]), min(int(seqlens[r]) + c, s - 1))
        assert_close("k", caches[2][:, r, rows], caches[0][:, r, rows], TOL[dtype])
        assert torch.equal(caches[3][:, r, rows], caches[1][:, r, rows])
        assert caches[2][:, r, : int(seqlens[r])].isnan().all()  # nothing else is written


def test_context_rows_none_is_a_no_op(device):
    cache = torch.zeros(2, 1, 8, 2, 16, device=device)
    qkv = torch.randn(1, 0, 2, 8, 16, device=device)
    seqlens = torch.zeros(1, dtype=torch.int64, device=device)
    weight = torch.ones(2, 16, device=device)
    kernels.context_kv_write(qkv, weight, seqlens, inv_freq(16, device), 1e-6, 4, cache, cache.clone())
    assert not cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_the_drafter_modules(dtype):
    """ref.block_qkv == q_norm / k_norm then apply_rope with rope_cos_sin, as DFlashAttention does."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, g, d = 2, 6, 4, 2, 32
    qkv = torch.randn(b, t, h + 2 * g, d, generator=gen).to(dtype)
    q_norm, k_norm = RMSNorm(d).to(dtype), RMSNorm(d).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(norms(d, dtype, "cpu", gen))
        k_norm.weight.copy_(norms(d, dtype, "cpu", gen))
    start = torch.tensor([3, 900])
    cos, sin = rope_cos_sin(start[:, None] + torch.arange(t), d, THETA, dtype)
    want_q = apply_rope(q_norm(qkv[:, :, :h]), cos, sin)
    want_k = apply_rope(k_norm(qkv[:, :, h : h + g]), cos, sin)
    q, k, _ = ref.block_qkv(qkv, q_norm.weight, k_norm.weight, start, inv_freq(d, "cpu"), 1e-6, h)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert_close("q", q, want_q, tol)
    assert_close("k", k, want_k, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qwen3_shapes(dtype):
    """Qwen3-8B-class heads (h 32, g 8, d 128), positions up to 40k."""
    test_block_kernel_matches_reference(torch.device("cuda"), dtype, 4, 16, 32, 8, 128)
    test_context_kernel_matches_reference(torch.device("cuda"), dtype, 3, 16, 5, 32, 8, 128)
