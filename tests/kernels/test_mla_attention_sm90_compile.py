"""The sm_90 Gluon attention kernels, compiled on the CPU for an H200 (sm_90a) with the ptxas and
cuobjdump shipped in the Triton wheel. The interpreter cannot run Gluon, so this is what CI checks of
them without a GPU: they build for every variant and cache layout, fit the 227 KB of shared memory,
spill nothing, and issue the tensor-core products of the design: per warpgroup and tile, 36 score
products of width BN / 2 (the score tile is split by columns between the two warpgroups: each score
is computed once) and BN / 16 P V products of width 256 (half of d_c each). Numerics are checked by
the GPU tests in test_mla_attention.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kdtree_engine.kernels import mla_attention_sm90 as k
from kdtree_engine.kernels import mla_attention_roles as roles

bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
I32 = ("page_size", "stride_qb", "stride_kb", "stride_ks", "stride_btb", "stride_pb", "stride_ps",
       "stride_lb", "stride_ls")
ALIGNED = ("stride_qb", "stride_kb", "stride_ks", "stride_pb", "stride_ps", "stride_lb", "stride_ls")
prefix_sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "seqlens_ptr": "*i32", "bt_ptr": "*i32",
              "part_ptr": "*fp32", "plse_ptr": "*fp32", "T": "i32", "M": "i32", "num_splits": "i32",
              "qk_scale": "fp32"}
prefix_sig.update({name: "i32" for name in I32})
prefix_sig.update({name: "constexpr" for name in ("D_C", "D_R", "BM", "BN", "PAGED", "num_warps")})
sched_sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "seqlens_ptr": "*i32", "bt_ptr": "*i32", "vis_ptr": "*u8",
             "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_ptr": "*fp32", "plse_ptr": "*fp32"}
sched_sig.update({name: "i32" for name in ("T", "H", "M", "MB", "NT", "PER", "n_units")})
sched_sig["qk_scale"] = "fp32"
sched_sig.update({name: "i32" for name in I32[:5] + ("stride_vb", "stride_vi") + I32[5:]})
CST = ("D_C", "D_R", "BM", "BN", "PAGED", "MASK_MODE", "num_warps")
sched_sig.update({name: "constexpr" for name in CST})
import torch
from triton.runtime.jit import mangle_type
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
box = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
flat = torch.zeros(128, 576, dtype=torch.bfloat16)
desc = TensorDescriptor(flat, [128, 576], [576, 1], [64, 64], box)
pipe_sig = {"q_ptr": "*bf16", "desc": mangle_type(desc)}
pipe_sig.update({name: sched_sig[name] for name in ("seqlens_ptr", "bt_ptr", "vis_ptr", "out_ptr", "lse_ptr",
                                                   "part_ptr", "plse_ptr", "T", "H", "M", "MB", "NT", "PER",
                                                   "n_units", "qk_scale")})
pipe_sig.update({"cap": "i32", "page_size": "i32", "stride_qb": "i32", "stride_btb": "i32"})
pipe_sig.update({name: "i32" for name in ("stride_vb", "stride_vi") + I32[5:]})
pipe_sig.update({name: "constexpr" for name in CST})
roles_sig = {name: ty for name, ty in pipe_sig.items() if name not in ("BM", "BN")}
builds = [(v, v, paged, 0) for v in ("double", "wide") for paged in (False, True)]
builds += [("sched", "sched", False, 0), ("sched", "sched", True, 0), ("sched-bits", "sched", False, 1)]
builds += [("pipe", "pipe", False, 0), ("pipe", "pipe", True, 0), ("pipe-bits", "pipe", False, 1)]
builds += [("roles", "roles", False, 0), ("roles", "roles", True, 0), ("roles-bits", "roles", False, 1)]
builds += [("roles-ones", "roles", False, 1)]  # with the JIT's constexpr specialization of ints equal to 1
ONES = ("T", "MB", "page_size", "stride_btb")  # t = 1, one row block, a contiguous cache
found = {}
for name, variant, paged, mode in builds:
    fn, bn = (roles._roles_kernel, k.tile_rows("roles")) if variant == "roles" else k.VARIANTS[variant]
    sig = dict({"sched": sched_sig, "pipe": pipe_sig, "roles": roles_sig}.get(variant, prefix_sig))
    if mode == 1:
        sig["vis_ptr"] = "*i64"
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n in ALIGNED]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # what the JIT specializes
    cst = {"D_C": 512, "D_R": 64, "BM": k.BLOCK_M, "BN": bn, "PAGED": paged, "num_warps": k.NUM_WARPS}
    if variant in ("sched", "pipe", "roles"):
        cst["MASK_MODE"] = mode
    if variant == "roles":  # one warpgroup; the other is its warp_specialize worker partition
        cst = {key: val for key, val in cst.items() if key not in ("BM", "BN")} | {"num_warps": 4}
    if name == "roles-ones":  # arguments the partitions get must survive being constexpr
        sig.update({n: "constexpr" for n in ONES})
        cst.update({n: 1 for n in ONES})
    kernel = triton.compile(GluonASTSource(fn, sig, cst, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cst["num_warps"]})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    mma = {}
    for shape in re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass):
        mma[shape] = mma.get(shape, 0) + 1
    found[f"{name}-{'paged' if paged else 'contiguous'}"] = {
        "bn": bn, "shared": kernel.metadata.shared, "local": int(re.search(r"LOCAL:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
        "warps": kernel.metadata.num_warps, "mma": mma}
print(json.dumps(found))
"""

MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)


@pytest.fixture(scope="module")
def compiled() -> dict:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no ptxas / cuobjdump")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "variant, cache",
    [(v, c) for v in ("sched", "double", "wide") for c in ("contiguous", "paged")]
    + [("sched-bits", "contiguous"), ("pipe", "contiguous"), ("pipe", "paged"), ("pipe-bits", "contiguous")]
    + [("roles", "contiguous"), ("roles", "paged"), ("roles-bits", "contiguous")]
    + [("roles-ones", "contiguous")],
)
def test_sm90_kernel_builds_as_designed(compiled, variant, cache):
    got = compiled[f"{variant}-{cache}"]
    bn = got["bn"]
    assert got["shared"] <= MAX_SHARED, got
    assert got["local"] == 0, f"register spills: {got}"
    # a few spilled scalars at most: 255 registers hold the accumulators; a spill of the tensor-core
    # operands' shared-memory descriptors (once 336 bytes of stack) made "pipe" 25-30 % slower
    assert got["stack"] <= 64, f"register spills: {got}"
    # per warpgroup and tile: (512 + 64) / 16 score products, each BN / 2 columns wide; BN / 16 P V
    # products over half of d_c ("pipe": over each quarter of d_c, one per latent half); nothing else
    if variant.startswith("roles"):
        # warpgroup 0: the whole 64 x 64 score tile (36 products) and P V over the first latent half (4);
        # warpgroup 1 (the worker partition): P V over the second half (4); 8 warps in all
        assert got["mma"] == {"64x64x16": 36, "64x256x16": 8}, got["mma"]
        assert got["warps"] == 8, got
    elif variant.startswith("pipe"):
        assert got["mma"] == {f"64x{bn // 2}x16": 36, "64x128x16": bn // 8}, got["mma"]
    else:
        assert got["mma"] == {f"64x{bn // 2}x16": 36, "64x256x16": bn // 16}, got["mma"]
