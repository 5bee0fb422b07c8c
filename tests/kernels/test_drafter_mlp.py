"""The drafter's SiLU * up kernel (kernels/drafter_mlp.py) against its float32 reference
(ref/drafter_mlp.py) and the drafter's torch MLP activation (F.silu(gate) * up, rounded twice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.kernels.test_drafter_attention import assert_close

from kdtree_engine.kernels.drafter_mlp import silu_mul
from kdtree_engine.ref.drafter_mlp import silu_mul as reference

TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, inter", [(1, 16), (16, 1024), (5, 1500), (0, 8)])
def test_kernel_matches_reference(device, dtype, m, inter):
    gen = torch.Generator().manual_seed(m + inter)
    gate_up = (4 * torch.randn(m, 2 * inter, generator=gen)).to(device=device, dtype=dtype)
    got = silu_mul(gate_up)
    assert got.shape == (m, inter) and got.dtype == dtype
    if m:
        assert_close("silu_mul", got, reference(gate_up), TOL[dtype])
        gate, up = gate_up.chunk(2, dim=-1)
        assert_close("torch", got, F.silu(gate) * up, 2 * TOL[dtype])


def test_strided_rows(device):
    gate_up = torch.randn(6, 64, device=device)[::2]
    assert_close("strided", silu_mul(gate_up), reference(gate_up), 1e-6)
