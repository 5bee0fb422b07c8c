"""The forward's GEMM mode (model.linear.gemm_mode): the reference path keeps torch's GEMMs (autograd,
training), the row-invariant forward its GEMM, and the kernel path takes the small-M GEMM where launches
use PDL; the small-M projections equal F.linear within bf16 rounding and leave larger or float32 ones
to torch. Through the Triton interpreter on the CPU; the GPU runs them in every model test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdtree_engine.model import linear as model_linear


def test_mode_by_path_invariance_and_pdl(monkeypatch):
    pytest.importorskip("triton")
    from kdtree_engine.kernels import _pdl

    cpu = torch.device("cpu")
    assert model_linear.gemm_mode(False, True, cpu) == "torch"
    assert model_linear.gemm_mode(True, True, cpu) == "invariant"
    assert model_linear.gemm_mode(True, False, cpu) == "torch"  # no PDL on the CPU
    monkeypatch.setattr(_pdl, "enabled", lambda device: True)
    assert model_linear.gemm_mode(True, False, cpu) == "small_m"
    assert model_linear.gemm_mode(False, False, cpu) == "torch"


@pytest.mark.parametrize("rows", [1, 16, 33])
def test_small_m_projection_equals_f_linear(rows):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=gen).bfloat16()
    w, b = torch.randn(72, 96, generator=gen).bfloat16(), torch.randn(72, generator=gen).bfloat16()
    want = F.linear(x.float(), w.float(), b.float())
    got = model_linear.linear(x, w, b, "small_m")
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 72)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    heads = torch.randn(3, rows, 32, generator=gen).bfloat16()
    wh = torch.randn(3, 32, 40, generator=gen).bfloat16()
    out = torch.empty(3, rows, 40, dtype=torch.bfloat16)
    model_linear.per_head_into(heads, wh, out, "small_m")
    want_h = torch.bmm(heads.float(), wh.float())
    torch.testing.assert_close(out.float(), want_h, rtol=1e-2, atol=1e-2 * float(want_h.abs().max()))


def test_small_m_leaves_float32_and_many_rows_to_torch(monkeypatch):
    """The small-M GEMM is not called for float32 activations or for rows past the rule."""
    from kdtree_engine.kernels import linear as kernel_linear

    monkeypatch.setattr(kernel_linear, "linear", lambda *a, **k: pytest.fail("the small-M GEMM ran"))
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    assert torch.equal(model_linear.linear(x, w, None, "small_m"), F.linear(x, w))
    xb, wb = torch.randn(80, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert torch.equal(model_linear.linear(xb, wb, None, "small_m"), F.linear(xb, wb))
