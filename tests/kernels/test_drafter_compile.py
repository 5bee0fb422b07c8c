"""The drafter's Triton kernels compiled on the CPU for an H200 (sm_90) with the ptxas and cuobjdump
shipped in the Triton wheel: what CI checks without a GPU beyond the interpreter's numerics. Every
kernel builds at the kimi-nano shapes and at Qwen3-8B-class heads (d = 128, h / g = 4), in bf16 and
float32, with the constexprs the launch wrappers choose, and spills no register."""

from __future__ import annotations

import pytest
from tests.kernels.offline_compile import BUILD, MAX_SHARED, run_compile_script

COMPILE = (
    BUILD
    + r"""
import torch
from kdtree_engine.kernels import drafter_attention as attn, drafter_mlp as mlp, drafter_qkv as qkv

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
found = {}
for dt in DT:
    ptr = "*" + dt
    sig = {"q_ptr": ptr, "ck_ptr": ptr, "cv_ptr": ptr, "len_ptr": "*i64", "kb_ptr": ptr, "vb_ptr": ptr,
           "out_ptr": ptr, "part_ptr": "*fp32", "plse_ptr": "*fp32", "T": "i32", "num_splits": "i32",
           "qk_scale": "fp32"}
    sig.update(i32("stride_qb", "stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bb",
                   "stride_bt", "stride_bh", "stride_ob", "stride_ot", "stride_oh"))
    for t, h, g, d in ((16, 8, 4, 32), (1, 4, 4, 32), (16, 32, 8, 128), (1, 32, 8, 128)):
        for split in (False, True):
            cst = dict(attn.launch_constants(t, h, g, d, DT[dt]), ALIGN=16 // DT[dt].itemsize, SPLIT=split)
            warps = cst.pop("num_warps")
            key = f"attention-{dt}-t{t}-h{h}-g{g}-d{d}-split{int(split)}"
            found[key] = build(attn._drafter_attention_kernel, sig, cst, warps)
    sig = {"qkv_ptr": ptr, "qw_ptr": ptr, "kw_ptr": ptr, "start_ptr": "*i64", "inv_ptr": "*fp32"}
    sig.update(i32("T", "stride_b", "stride_t", "stride_h"), eps="fp32")
    for h, g, d in ((8, 4, 32), (32, 8, 128), (8, 2, 24)):
        p2 = triton.next_power_of_2
        cst = dict(H=h, G=g, HALF=d // 2, HALF_P=p2(d // 2), H_P=p2(h), G_P=p2(g))
        found[f"block-{dt}-h{h}-g{g}-d{d}"] = build(qkv._block_kernel, sig, cst)
        cst.pop("H_P")
        sig_c = {"qkv_ptr": ptr, "kw_ptr": ptr, "seq_ptr": "*i64", "inv_ptr": "*fp32"}
        sig_c.update(ck_ptr=ptr, cv_ptr=ptr)
        sig_c.update(i32("C", "stride_b", "stride_c", "stride_l", "stride_h", "stride_wl", "stride_kl",
                         "stride_kb", "stride_ks", "stride_kh", "max_slot"), eps="fp32")
        found[f"context-{dt}-h{h}-g{g}-d{d}"] = build(qkv._context_kernel, sig_c, cst)
    sig = {"in_ptr": ptr, "out_ptr": ptr}
    sig.update(i32("inter", "stride_in", "stride_out"))
    found[f"silu_mul-{dt}"] = build(mlp._silu_mul_kernel, sig, {"BLOCK": mlp.BLOCK})
print(json.dumps(found))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_script(COMPILE)


def test_every_drafter_kernel_builds_for_sm90_without_spills(compiled):
    assert len(compiled) == 2 * (4 * 2 + 3 + 3 + 1)
    for name, got in compiled.items():
        assert got["shared"] <= MAX_SHARED, (name, got)
        assert got["local"] == 0, f"{name}: register spills {got}"
