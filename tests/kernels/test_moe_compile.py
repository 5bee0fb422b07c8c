"""The MoE kernels (kernels/moe.py) compiled on the CPU for an H200 (sm_90) with the ptxas and cuobjdump
shipped in the Triton wheel: what CI checks without a GPU beyond the interpreter's numerics. The tile
map (counting sort) at 16, 32 and 384 experts (Kimi-K2), the grouped GEMMs with the shared-expert
branch at every launch configuration in bf16 and float32, the combine, and the router's partial-logit
matmul and routing (kimi-nano, scaled-down Kimi, DeepSeek-V3, Kimi-K2), with the constexprs the launch
wrappers choose: every kernel builds and spills no register."""

from __future__ import annotations

import pytest
from tests.kernels.offline_compile import BUILD, MAX_SHARED, run_compile_script

COMPILE = (
    BUILD
    + r"""
from kdtree_engine.kernels import moe, moe_router as router

found = {}
sig = {"ids_ptr": "*i64", "order_ptr": "*i64", "bounds_ptr": "*i32", "tile_expert_ptr": "*i32",
       "tile_row_ptr": "*i32", **i32("NA", "E", "T")}
for e in (16, 32, 384):
    cst = dict(EP=triton.next_power_of_2(e), CHUNK=moe.MAP_CHUNK, ROWS=moe.sort_rows(e), BLOCK_M=16)
    found[f"tile_map-e{e}"] = build(moe._tile_map_kernel, sig, cst)
tiling = {"order_ptr": "*i64", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "bounds_ptr": "*i32",
          **i32("N", "NA", "H", "I", "IS", "IH", "TOPK", "E", "S")}
for dt, size in (("bf16", 2), ("fp32", 4)):
    ptr = "*" + dt
    for n_assign, e in ((6, 32), (198, 32), (600, 32), (4096, 32)):  # the four launch configurations
        launch = moe.launch_config(n_assign, e, size)
        for name, fn, sig, b in (
            ("gate_up", moe._gate_up_kernel,
             {"x_ptr": ptr, "w_ptr": ptr, "ws_gate_ptr": ptr, "ws_up_ptr": ptr, "h_ptr": ptr, **tiling},
             launch.gate_up),
            ("down", moe._down_kernel,
             {"h_ptr": ptr, "w_ptr": ptr, "ws_down_ptr": ptr, "rw_ptr": "*fp32", "y_ptr": "*fp32", **tiling},
             launch.down),
        ):
            cst = dict(BLOCK_M=launch.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, PRECISION="ieee")
            key = f"{name}-{dt}-m{launch.block_m}-a{n_assign}"
            found[key] = build(fn, sig, cst, b.num_warps, b.num_stages)
    sig = {"y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": ptr, **i32("NA", "H")}
    for shared in (True, False):
        cst = dict(TOPK=6, SHARED=shared, BLOCK=moe.COMBINE_BLOCK)
        found[f"combine-{dt}-shared{int(shared)}"] = build(moe._combine_kernel, sig, cst)
for dt in ("bf16", "fp32"):
    sig = {"x_ptr": "*" + dt, "w_ptr": "*fp32", "part_ptr": "*fp32", **i32("N", "H", "E", "stride_x")}
    for e, hidden in ((16, 2048), (32, 2048), (384, 7168)):
        lo = router.logit_launch(hidden, e)
        cst = dict(CHUNK=lo.chunk, BLOCK_M=router.LOGIT_ROWS, BLOCK_E=lo.block_e, BLOCK_K=lo.block_k)
        found[f"router_logits-{dt}-e{e}"] = build(router._logits_kernel, sig, cst, warps=lo.num_warps)
sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
       **i32("stride", "part_stride"), "scaling": "fp32"}
for e, groups, keep, k in ((384, 1, 1, 8), (256, 8, 4, 8), (32, 1, 1, 6), (16, 4, 2, 4)):
    gp, sp = triton.next_power_of_2(groups), triton.next_power_of_2(e // groups)
    cst = dict(N_GROUP=groups, GROUP_SIZE=e // groups, TOPK_GROUP=keep, TOP_K=k, NORM=True, GP=gp, SP=sp,
               KP=triton.next_power_of_2(k), INTERPRET=False, S=router.MAX_PARTS)
    found[f"route-e{e}"] = build(router._route_kernel, sig, cst, warps=router.num_warps(gp * sp))
print(json.dumps(found))
"""
)


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_script(COMPILE)


def test_every_moe_kernel_builds_for_sm90_without_spills(compiled):
    assert len(compiled) == 3 + 2 * (4 * 2 + 2) + 2 * 3 + 4
    for name, got in compiled.items():
        assert got["shared"] <= MAX_SHARED, (name, got)
        assert got["local"] == 0, f"{name}: register spills {got}"
