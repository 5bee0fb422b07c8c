"""The row-invariant projection y = x W^T + b (issue 32: greedy DDTree equal to autoregressive decoding
bit for bit in bf16): the kernel twin of ref/linear.py.

Why. cuBLAS picks its tiling, split of K and MMA instruction by the number of rows M, so the same token
row gets other bits when it is decoded alone (M = 1), verified among 33 tree nodes, or batched with 63
other requests; a near-tie in the logits then flips a greedy token. Here every launch has the same
configuration whatever M is:

- BLOCK_M = 16 rows per program (tl.dot's minimum), BLOCK_N and BLOCK_K a function of (N, K, dtype)
  only (`launch_config`), no split of K, M not specialized by the compiler (do_not_specialize: M = 1
  compiles the same kernel as M = 4096);
- an output element y[m, n] is the float32 sum of x[m, k] W[n, k] over k in BLOCK_K steps, in increasing
  k, one tl.dot per step, whatever the other rows of its tile are; the bias is added in float32 and the
  result rounded once to x's dtype.

A row's bits therefore depend only on its own values, N and K: the same row gives the same bits at any
position of any launch. Float32 inputs use IEEE products (no TF32).

Speed. Decode and verify sizes (M up to a few hundred) are bound by the weight read: each program reads
a BLOCK_N slice of W once, and the programs of one slice follow one another in launch order (the row
tile varies fastest), so the row tiles of a slice share it through the L2 cache. Large M (prefill) runs
16-row tiles where cuBLAS would take 128 or more: slower, the price of the invariance, measured against
cuBLAS in the GPU tests' companion benchmark before the model uses it. The row strides stay out of
Triton's specialization and come with their alignment (kernels/_align.py), so the x tiles are copied
asynchronously, 16 bytes at a time, like the weight tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._align import aligned, stride_align
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref.linear import check_linear_args, linear_ref

BLOCK_M = 16


@dataclass(frozen=True)
class Launch:
    """BLOCK_N output columns and BLOCK_K reduction steps per program, warps and pipeline stages: the same
    for every M."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_config(n: int, k: int, itemsize: int) -> Launch:
    """The launch for W [n, k] of itemsize bytes: 256 bytes of each of 64 weight rows per reduction step
    (BLOCK_K 128 for 16-bit weights), four steps in flight; narrower blocks where N or K is smaller."""
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(256 // itemsize, max(16, triton.next_power_of_2(k)))
    return Launch(block_n, block_k, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M", "stride_xb", "stride_xm", "stride_yb", "stride_ym"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xb, stride_xm, stride_wb, stride_wn, stride_wk,
                   stride_yb, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ALIGN: tl.constexpr,
                   PDL: tl.constexpr = False):  # fmt: skip
    """Program (row tile, column block, batch): y[batch, rows, cols] = x[batch, rows] W[batch, cols]^T
    (+ b[cols]), accumulated in float32 over K in BLOCK_K steps, rounded once. x and y have unit stride
    along K and N, their row and batch strides multiples of ALIGN; W any strides."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    stride_xb, stride_xm = aligned(stride_xb, ALIGN), aligned(stride_xm, ALIGN)
    stride_yb, stride_ym = aligned(stride_yb, ALIGN), aligned(stride_ym, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    batch = tl.program_id(2).to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + batch * stride_xb + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + batch * stride_wb + cols[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + kk
        k_ok = ks < K
        xa = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_tile = w_cols + ks[:, None].to(tl.int64) * stride_wk  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(xa, tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0), acc,
                     input_precision=PRECISION)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + batch * stride_yb + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """x [B, M, K], weight [B, N, K] (any strides), y [B, M, N]; x and y with unit stride along K, N."""
    nb, m, k = x.shape
    n = weight.shape[1]
    if m == 0 or nb == 0:
        return
    cfg = launch_config(n, k, x.element_size())
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n), nb)
    read = (x.stride(1), y.stride(1)) + ((x.stride(0), y.stride(0)) if nb > 1 else ())  # one batch: unread
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee", ALIGN=stride_align(x.element_size(), *read), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch(x.device),
    )  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None, one dtype (float32, bfloat16 or float16; float64 runs
    the reference) -> [..., N] in x's dtype, each row's bits independent of the other rows (module
    docstring). One launch, no host sync; M = 0 rows gives an empty output."""
    n, k = check_linear_args(x, weight, bias)
    if x.dtype == torch.float64:
        return linear_ref(x, weight, bias)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    _launch(rows[None], weight[None], bias, y[None])
    return y.view(*x.shape[:-1], n)


def batched_linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = x[i] weight[i]^T for each i: x [B, M, K], weight [B, N, K] (any strides: a transposed
    view is read in place), out [B, M, N] (may be a strided view, e.g. columns of a wider buffer), one
    dtype (float32, bfloat16 or float16); x and out with unit stride along their last dim. The
    per-head projections of MLA (W_UK, W_UV) as row-invariant GEMMs. Returns out."""
    if x.dim() != 3 or weight.dim() != 3 or out.dim() != 3:
        raise ValueError("batched_linear_into: expected x [B, M, K], weight [B, N, K], out [B, M, N]")
    nb, m, k = x.shape
    if weight.shape[0] != nb or weight.shape[2] != k or tuple(out.shape) != (nb, m, weight.shape[1]):
        raise ValueError(
            f"batched_linear_into: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}"
        )
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not (x.dtype == weight.dtype == out.dtype):
        raise ValueError("batched_linear_into: x and out need unit stride along their last dim, one dtype")
    _launch(x, weight, None, out)
    return out
