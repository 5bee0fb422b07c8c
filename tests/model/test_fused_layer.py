"""The fused MLA layer path (latent row write in one launch, the absorbed query written in place, the
residual add fused with the next RMSNorm) against the unfused kernel path it replaces, through the
whole model: logits and every cache row bit for bit, in float32 and bf16, for a ragged prefill, a
decode step and a 33-token verify that fills the cache to its last row; and against impl="ref". On
CUDA the one GEMM for q_a_proj + kv_a_proj_with_mqa may pick another cuBLAS algorithm than the two it
replaces, so there the paths are compared under bf16 / float32 tolerances; the CPU run (the Triton
interpreter) is bit for bit."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels import rmsnorm as rmsnorm_kernels
from kdtree_engine.model.mla import MLAttention
from kdtree_engine.model.testing import random_model, tiny_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _unfused(monkeypatch) -> None:
    """The kernel path as it was: norm + rope + cat + index_put, cat of the query, add then norm."""
    monkeypatch.setattr(MLAttention, "_kernels_apply", lambda *a: False)

    def add_then_norm(x, delta, weight, eps):
        x = x + delta
        return x, rmsnorm_kernels.rmsnorm(x, weight, eps)

    monkeypatch.setattr(rmsnorm_kernels, "add_rmsnorm", add_then_norm)


def _run(model, impl):
    model = model.to(DEVICE)
    """Ragged prefill (b = 2), one decode step, then a 33-token chain that ends at the cache's last row;
    returns every logits tensor and the cache."""
    gen = torch.Generator().manual_seed(3)
    cache = model.new_cache(2, 5 + 1 + 33)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=gen).to(DEVICE)
    out = [model(ids, cache, lengths=torch.tensor([5, 3], device=DEVICE), impl=impl).logits]
    cache.seqlens.fill_(5)  # both rows at 5: the verify fills row 38 = max_len - 1
    out.append(model(ids[:, :1], cache, impl=impl, capture_layers=(0, 3)).hidden)
    out.append(model(torch.randint(0, 128, (2, 33), generator=gen).to(DEVICE), cache, impl=impl).logits)
    return out, cache.kv


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    if DEVICE.type == "cuda":  # see the module's docstring
        tol = 1e-4 if a.dtype == torch.float32 else 5e-2
        return torch.allclose(a.nan_to_num().float(), b.nan_to_num().float(), rtol=tol, atol=tol)
    return torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_fused_path_is_bit_identical_to_the_unfused_kernel_path(monkeypatch, dtype, interleave):
    model = random_model(tiny_config(rope_interleave=interleave), dtype=dtype)
    fused, kv = _run(model, "triton")
    with monkeypatch.context() as m:
        _unfused(m)
        unfused, kv_unfused = _run(model, "triton")
    assert _same(kv, kv_unfused)
    for got, want in zip(fused, unfused, strict=True):
        assert _same(got, want)
    if dtype == torch.float32:
        ref, kv_ref = _run(model, "ref")
        torch.testing.assert_close(kv.nan_to_num(), kv_ref.nan_to_num(), rtol=1e-4, atol=1e-4)
        for got, want in zip(fused, ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dense_query_without_q_lora(monkeypatch):
    model = random_model(tiny_config(q_lora_rank=None))
    fused, kv = _run(model, "triton")
    with monkeypatch.context() as m:
        _unfused(m)
        unfused, kv_unfused = _run(model, "triton")
    assert _same(kv, kv_unfused) and all(_same(a, b) for a, b in zip(fused, unfused, strict=True))


def test_fused_projection_keeps_the_parameters_as_views(monkeypatch):
    model = random_model(tiny_config(num_hidden_layers=2)).to(DEVICE)
    names = [n for n, _ in model.named_parameters()]
    attn = model.layers[0].self_attn
    before = model(torch.tensor([[3, 4]], device=DEVICE), model.new_cache(1, 4), impl="triton").logits
    w, _, _ = attn._fused_a
    q = attn.q_a_proj.weight.shape[0]
    assert attn.q_a_proj.weight.data_ptr() == w.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == w[q:].data_ptr()
    assert [n for n, _ in model.named_parameters()] == names  # checkpoint names unchanged
    with torch.no_grad():
        attn.kv_a_proj_with_mqa.weight.mul_(2)  # an in-place update writes through to the fused weight
    assert torch.equal(w[q:], attn.kv_a_proj_with_mqa.weight)
    model.to(torch.float64).to(torch.float32)  # new storage: the views break, the next call packs again
    after = model(torch.tensor([[3, 4]], device=DEVICE), model.new_cache(1, 4), impl="triton").logits
    assert attn._fused_a[0].data_ptr() == attn.q_a_proj.weight.data_ptr()
    assert not torch.equal(before, after)  # the doubled kv_a weight is what the fused GEMM read
    ref = model(torch.tensor([[3, 4]], device=DEVICE), model.new_cache(1, 4), impl="ref").logits
    torch.testing.assert_close(after, ref, rtol=1e-4, atol=1e-4)
