"""The DFlash drafter's SwiGLU activation on a fused gate/up projection in one launch: the kernel twin
of ref/drafter_mlp.py (float32 math, rounded once)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release

BLOCK = 1024


@triton.jit(do_not_specialize=["stride_in", "stride_out"])
def _silu_mul_kernel(
    in_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    """Program (row, column block): out[row, cols] = silu(in[row, cols]) * in[row, inter + cols]."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(in_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (rows of contiguous columns) -> silu(gate) * up [M, I] contiguous, same dtype."""
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, inter, dtype=gate_up.dtype, device=gate_up.device)
    if m:
        block = min(BLOCK, triton.next_power_of_2(inter))
        grid = (m, triton.cdiv(inter, block))
        _silu_mul_kernel[grid](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, **pdl.launch(gate_up.device)
        )
    return out
