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

The small-M launch (`invariant=False`, at most SMALL_M rows): the same kernel for the default mode's
projections, where cuBLAS reads a few MB of weights per call at a fraction of the memory's rate and
breaks the chain of PDL launches (kernels/_pdl.py). One row tile holds every row (BLOCK_M = M rounded
up to a power of two, 16 at least), so the weight is read once; the columns are cut into narrow blocks
(`small_m_launch`) so that a weight of a few MB gives every multiprocessor a program; and the first
weight tile is loaded before the PDL wait (`weight_first=True`: only for weights that no kernel of the
stream writes, such as a model's parameters), so its memory latency overlaps the predecessor's tail. A
row's bits then depend on M's tile (not row-invariant: that is the invariant launch's job).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._align import aligned, stride_align
from kdtree_engine.kernels._device import device_multiprocessors
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref.linear import check_linear_args, linear_ref

BLOCK_M = 16
SMALL_M = 64  # the most rows of the small-M launch
SMALL_WEIGHT = 4 << 20  # bytes: a weight this small is read in a launch's fixed time at any M <= SMALL_M


@dataclass(frozen=True)
class Launch:
    """BLOCK_N output columns and BLOCK_K reduction steps per program, warps and pipeline stages: the same
    for every M."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M


def launch_config(n: int, k: int, itemsize: int) -> Launch:
    """The launch for W [n, k] of itemsize bytes: 256 bytes of each of 64 weight rows per reduction step
    (BLOCK_K 128 for 16-bit weights), four steps in flight; narrower blocks where N or K is smaller."""
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(256 // itemsize, max(16, triton.next_power_of_2(k)))
    return Launch(block_n, block_k, num_warps=4, num_stages=4)


def small_m_launch(m: int, n: int, k: int, itemsize: int, sms: int) -> Launch:
    """The small-M launch for M <= SMALL_M rows of a weight [n, k] on a GPU of `sms` multiprocessors: one
    row tile of every row, 16-column blocks where 32-column ones would give fewer than two programs a
    multiprocessor, 128 bytes of a weight row per step (256 where K allows and the row tile is small),
    four steps in flight."""
    if not 0 < m <= SMALL_M:
        raise ValueError(f"small_m_launch: M must be in 1..{SMALL_M}, got {m}")
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 16 if triton.cdiv(n, 32) < 2 * sms else 32
    step = 256 if block_m <= 16 else 128
    block_k = min(step // itemsize, max(16, triton.next_power_of_2(k)))
    return Launch(block_n, block_k, num_warps=4, num_stages=4, block_m=block_m)


def small_m_wins(m: int, weight_bytes: int) -> bool:
    """Whether the small-M launch (with PDL) replaces cuBLAS for M rows of a weight of `weight_bytes`:
    one 16-row tile (M <= 16) at any size, and up to SMALL_M rows for a weight of at most SMALL_WEIGHT
    bytes, where the launch's fixed cost, which PDL overlaps, is the whole cost. Chosen on the forwards
    of kimi-nano and the 2.5B shape (docs/engine.md): larger weights at M = 33 ran slower than cuBLAS."""
    return 0 < m <= 16 or (0 < m <= SMALL_M and weight_bytes <= SMALL_WEIGHT)


@triton.jit(do_not_specialize=["M", "stride_xb", "stride_xm", "stride_yb", "stride_ym"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xb, stride_xm, stride_wb, stride_wn, stride_wk,
                   stride_yb, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ALIGN: tl.constexpr,
                   WEIGHT_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """Program (row tile, column block, batch): y[batch, rows, cols] = x[batch, rows] W[batch, cols]^T
    (+ b[cols]), accumulated in float32 over K in BLOCK_K steps, rounded once. x and y have unit stride
    along K and N, their row and batch strides multiples of ALIGN; W any strides. WEIGHT_FIRST: the first
    weight tile is loaded before the PDL wait (W written by no kernel of the stream); the sum's order is
    the same either way."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    batch = tl.program_id(2).to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    w_cols = w_ptr + batch * stride_wb + cols[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]
    first_ok = (kk < K)[:, None] & col_ok[None, :]
    if WEIGHT_FIRST:
        w_first = tl.load(w_cols + kk[:, None].to(tl.int64) * stride_wk, mask=first_ok, other=0.0)
        wait_then_release(PDL)  # the weight is no predecessor's output; x and y are
    else:
        wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
        w_first = tl.load(w_cols + kk[:, None].to(tl.int64) * stride_wk, mask=first_ok, other=0.0)
    stride_xb, stride_xm = aligned(stride_xb, ALIGN), aligned(stride_xm, ALIGN)
    stride_yb, stride_ym = aligned(stride_yb, ALIGN), aligned(stride_ym, ALIGN)
    x_rows = x_ptr + batch * stride_xb + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    xa = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
    acc = tl.dot(xa, w_first, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), input_precision=PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
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


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            invariant: bool, weight_first: bool) -> None:  # fmt: skip
    """x [B, M, K], weight [B, N, K] (any strides), y [B, M, N]; x and y with unit stride along K, N;
    the invariant launch, or the small-M one where M <= SMALL_M and not `invariant`."""
    nb, m, k = x.shape
    n = weight.shape[1]
    if m == 0 or nb == 0:
        return
    if invariant or m > SMALL_M:
        cfg = launch_config(n, k, x.element_size())
    else:
        cfg = small_m_launch(m, n, k, x.element_size(), device_multiprocessors(x.device))
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), nb)
    read = (x.stride(1), y.stride(1)) + ((x.stride(0), y.stride(0)) if nb > 1 else ())  # one batch: unread
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee", ALIGN=stride_align(x.element_size(), *read), WEIGHT_FIRST=weight_first,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch(x.device),
    )  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, invariant: bool = True,
           weight_first: bool = False) -> torch.Tensor:  # fmt: skip
    """x [..., K], weight [N, K], bias [N] or None, one dtype (float32, bfloat16 or float16; float64 runs
    the reference) -> [..., N] in x's dtype, each row's bits independent of the other rows (module
    docstring), or with `invariant=False` the small-M launch where the rows number at most SMALL_M.
    weight_first: the weight is a parameter no kernel of the stream writes (read before the PDL wait).
    One launch, no host sync; M = 0 rows gives an empty output."""
    n, k = check_linear_args(x, weight, bias)
    if x.dtype == torch.float64:
        return linear_ref(x, weight, bias)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    _launch(rows[None], weight[None], bias, y[None], invariant, weight_first)
    return y.view(*x.shape[:-1], n)


def batched_linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, invariant: bool = True,
                        weight_first: bool = False) -> torch.Tensor:  # fmt: skip
    """out[i] = x[i] weight[i]^T for each i: x [B, M, K], weight [B, N, K] (any strides: a transposed
    view is read in place), out [B, M, N] (may be a strided view, e.g. columns of a wider buffer), one
    dtype (float32, bfloat16 or float16); x and out with unit stride along their last dim. The
    per-head projections of MLA (W_UK, W_UV) as row-invariant GEMMs (or, `invariant=False`, with the
    small-M launch where M <= SMALL_M; weight_first as for linear). Returns out."""
    if x.dim() != 3 or weight.dim() != 3 or out.dim() != 3:
        raise ValueError("batched_linear_into: expected x [B, M, K], weight [B, N, K], out [B, M, N]")
    nb, m, k = x.shape
    if weight.shape[0] != nb or weight.shape[2] != k or tuple(out.shape) != (nb, m, weight.shape[1]):
        raise ValueError(
            f"batched_linear_into: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}"
        )
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not (x.dtype == weight.dtype == out.dtype):
        raise ValueError("batched_linear_into: x and out need unit stride along their last dim, one dtype")
    _launch(x, weight, None, out, invariant, weight_first)
    return out
