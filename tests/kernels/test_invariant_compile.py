"""The row-invariant mode's kernels (issue 32) compiled on the CPU for an H200 (sm_90) with the ptxas and
cuobjdump shipped in the Triton wheel: the projection GEMM (kernels/linear.py) at Kimi-K2's projection
shapes and a small one, bf16 and float32, with and without bias; the Triton attention kernel at Kimi's
widths (512 + 64) in its default and row-invariant launches, for each mask mode, contiguous and paged.
Every kernel builds, fits the shared memory and spills no register."""

from __future__ import annotations

import pytest
from tests.kernels.offline_compile import BUILD, MAX_SHARED, run_compile_script

COMPILE = (
    BUILD
    + r"""
import torch
from kdtree_engine.kernels import linear, mla_attention_triton as att

found = {}
LINEAR_INTS = ("M", "N", "K", "stride_xb", "stride_xm", "stride_wb", "stride_wn", "stride_wk", "stride_yb",
               "stride_ym")
for dt, size in (("bf16", 2), ("fp32", 4)):
    for n, k in ((2112, 7168), (7168, 1024), (20480, 7168), (24, 40)):
        cfg = linear.launch_config(n, k, size)
        ptr = "*" + dt
        sig = {"x_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "y_ptr": ptr, **i32(*LINEAR_INTS)}
        for bias in (True, False):
            cst = dict(HAS_BIAS=bias, BLOCK_M=linear.BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       PRECISION="ieee", ALIGN=16 // size)
            key = f"linear-{dt}-{n}x{k}-bias{int(bias)}"
            found[key] = build(linear._linear_kernel, sig, cst, cfg.num_warps, cfg.num_stages)
STRIDES = ("page_size", "stride_qb", "stride_kb", "stride_ks", "stride_btb", "stride_vb", "stride_vi",
           "stride_ob", "stride_os", "stride_lb", "stride_ls", "stride_ab", "stride_ai")
for mode, vis in ((0, "*u8"), (1, "*i64"), (2, "*i64")):
    for chunk in (0, 1024):
        bf16 = torch.bfloat16
        cfg = att.invariant_config(bf16, 512) if chunk else att.pick_config(bf16, 264, 512)
        table = "*i32" if chunk and mode != 2 else "*i64"
        for paged in (False, True):
            sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "seqlens_ptr": "*i64", "vis_ptr": vis,
                   "anc_ptr": table, "bt_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32",
                   **i32("T", "H", "M", "num_splits"), "qk_scale": "fp32", **i32(*STRIDES)}
            cst = dict(D_C=512, D_R=64, BLOCK_DC=512, BLOCK_DR=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       PAGED=paged, MASK_MODE=mode, DOT_PREC="tf32", CHUNK=chunk, OUT_ALIGN=4)
            key = f"attention-mode{mode}-chunk{chunk}-paged{int(paged)}"
            found[key] = build(att._split_kv_kernel, sig, cst, cfg.num_warps, cfg.num_stages)
print(json.dumps(found))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_script(COMPILE)


def test_every_invariant_kernel_builds_for_sm90_without_spills(compiled):
    assert len(compiled) == 2 * 4 * 2 + 3 * 2 * 2
    for name, got in compiled.items():
        assert got["shared"] <= MAX_SHARED, (name, got)
        assert got["local"] == 0, f"{name}: register spills {got}"
