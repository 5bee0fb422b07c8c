"""The forward metadata of the `kdtree_mla` SGLang attention backend in one launch (its specification:
ref/sglang_attention.verify_metadata): per request, its length with the new tokens, its block-table row
read from SGLang's req_to_token, and its tree's ancestor bits, written straight into the caller's
buffers (the static buffers of a captured forward). Programs (request, chunk of BLOCK_C table columns):
a request's columns are copied in parallel, and only the pages its length reaches (a captured forward's
table is as wide as req_to_token, 160k columns at pages of 1 for a 160k context); the chunk-0 program
also writes the length and the bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.ref.sglang_attention import MAX_BITS

BLOCK_COLS = 1024  # table columns a program copies


@triton.jit
def _metadata_kernel(
    seq_lens_ptr,  # [bs] int
    pool_idx_ptr,  # [bs] int: req_to_token rows
    r2t_ptr,  # req_to_token [reqs, width] int32
    vis_ptr,  # visibility [NV, >= T, >= T] bool, or unused (HAS_TREE False)
    seqlens_ptr,  # out [bs] int32
    table_ptr,  # out [bs, >= COLS] int32
    bits_ptr,  # out [bs, T] int64, or unused
    T,
    NV,  # requests the visibility holds; later ones see only themselves
    COLS,
    PAGE,
    stride_r2t,
    stride_tb,
    stride_vb,
    stride_vi,
    HAS_TREE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    seqlen = (tl.load(seq_lens_ptr + b) + T).to(tl.int32)
    used = tl.minimum((seqlen + PAGE - 1) // PAGE, COLS)  # the columns the attention reads
    c = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    if chunk * BLOCK_C < used:
        row = r2t_ptr + tl.load(pool_idx_ptr + b).to(tl.int64) * stride_r2t
        token = tl.load(row + c.to(tl.int64) * PAGE, mask=c < used, other=0)
        tl.store(table_ptr + b.to(tl.int64) * stride_tb + c, (token // PAGE).to(tl.int32), mask=c < used)
    if chunk == 0:
        tl.store(seqlens_ptr + b, seqlen)
    if HAS_TREE and chunk == 0:
        i = tl.arange(0, BLOCK_T)[:, None]
        j = tl.arange(0, BLOCK_T)[None, :]
        inside = (i < T) & (j < T)
        seen = tl.load(
            vis_ptr + b.to(tl.int64) * stride_vb + i * stride_vi + j, mask=inside & (b < NV), other=0
        )
        vis = tl.where(b < NV, seen != 0, i == j) & inside
        weight = tl.full([1, BLOCK_T], 1, tl.int64) << j.to(tl.int64)
        bits = tl.sum(tl.where(vis, weight, 0), axis=1)  # distinct powers of two: the sum is their OR
        rows = tl.arange(0, BLOCK_T)
        tl.store(bits_ptr + b.to(tl.int64) * T + rows, bits, mask=rows < T)


def verify_metadata(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    visibility: torch.Tensor | None,
    t: int,
    page: int,
    seqlens: torch.Tensor,
    table: torch.Tensor,
    bits: torch.Tensor | None,
) -> None:
    """seqlens [bs] int32, table [bs, cols] int32 (unit column stride) and, for a tree of t <= MAX_BITS
    nodes, bits [bs, t] int64 (contiguous) <- ref.sglang_attention.verify_metadata of the same inputs
    (cols = table.shape[1]); visibility [>= 0, >= t, >= t] bool with unit column stride. A request's
    table columns past its last page (ceil((seq_len + t) / page)) are not written."""
    bs, cols = table.shape
    if bs == 0:
        return
    tree = visibility is not None and t <= MAX_BITS
    vis = visibility.view(torch.int8) if tree else seqlens
    nv, stride_vb, stride_vi = (vis.shape[0], vis.stride(0), vis.stride(1)) if tree else (0, 0, 0)
    block_c = min(BLOCK_COLS, triton.next_power_of_2(max(cols, 1)))
    _metadata_kernel[(bs, triton.cdiv(max(cols, 1), block_c))](
        seq_lens, req_pool_indices, req_to_token, vis, seqlens, table, bits if tree else seqlens, t, nv, cols,
        page, req_to_token.stride(0), table.stride(0), stride_vb, stride_vi,
        HAS_TREE=tree, BLOCK_C=block_c,
        BLOCK_T=triton.next_power_of_2(max(t, 1)), num_warps=4,
        **pdl.launch(seq_lens.device),
    )  # fmt: skip
