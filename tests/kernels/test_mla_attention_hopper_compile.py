"""The Hopper Gluon attention kernel, compiled on the CPU for an H200 (sm_90a) with the ptxas and
cuobjdump shipped in the Triton wheel. The interpreter cannot run Gluon, so this is what CI checks of
it without a GPU: it builds for every mask mode and cache layout, fits the 227 KB of shared memory,
spills nothing, and issues the tensor-core products of the design. Numerics are checked by the GPU
tests in test_mla_attention.py."""

from __future__ import annotations

import pytest
from tests.kernels.offline_compile import BUILD, MAX_SHARED, run_compile_script

COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from kdtree_engine.kernels import mla_attention_hopper as k

bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
box = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
desc = TensorDescriptor(torch.zeros(128, 576, dtype=torch.bfloat16), [128, 576], [576, 1], [64, 64], box)
SIG = {"q_ptr": "*bf16", "desc": mangle_type(desc), "kv_ptr": "*bf16", "seqlens_ptr": "*i32",
       "bt_ptr": "*i32", "vis_ptr": "*u8", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_ptr": "*fp32",
       "plse_ptr": "*fp32", "sched_ptr": "*i32"}
SIG.update({name: "i32" for name in ("NT", "PER", "UNITS", "GROUPS", "T", "H", "M", "B")})
SIG["qk_scale"] = "fp32"
SIG.update({name: "i32" for name in ("cap", "page_size", "stride_qb", "stride_btb", "stride_vb",
                                      "stride_vi")})
SIG.update({name: "constexpr" for name in ("D_C", "D_R", "PAGED", "MASK_MODE", "GATHER", "SCHED_ON_DEVICE",
                                           "num_warps")})
builds = [("visibility", False, 0), ("visibility", True, 0), ("bits", False, 1), ("causal", False, 2)]
builds += [("gather", True, 0), ("gather-bits", True, 1), ("gather-device", True, 0)]  # pages of 1 (SGLang)
builds += [("device", False, 0)]  # the schedule read from the device (a captured forward)
builds += [("ones", False, 1)]  # with the JIT's constexpr specialization of ints equal to 1
builds += [("pdl", False, 0)]  # launched with programmatic dependent launch (kernels/_pdl.py)
ONES = ("T", "B", "GROUPS", "page_size", "stride_btb", "NT", "PER")  # t = 1, b = 1, a contiguous cache
found = {}
for name, paged, mode in builds:
    sig = dict(SIG)
    if mode == 1:
        sig["vis_ptr"] = "*i64"
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n == "stride_qb"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # what the JIT specializes
    cst = {"D_C": 512, "D_R": 64, "PAGED": paged, "MASK_MODE": mode, "GATHER": name.startswith("gather"),
           "SCHED_ON_DEVICE": name.endswith("device"), "num_warps": 4}
    if name == "ones":  # arguments the partitions get must survive being constexpr
        sig.update({n: "constexpr" for n in ONES})
        cst.update({n: 1 for n in ONES})
    if name == "pdl":
        sig["PDL"], cst["PDL"] = "constexpr", True
    fn = k._attention_kernel
    kernel = triton.compile(GluonASTSource(fn, sig, cst, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cst["num_warps"], "launch_pdl": name == "pdl"})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    cp_async = len(re.findall(r"LDGSTS\.E\.BYPASS\.128", sass))
    mma = {}
    for shape in re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass):
        mma[shape] = mma.get(shape, 0) + 1
    found[f"{name}-{'paged' if paged else 'contiguous'}"] = {
        "shared": kernel.metadata.shared, "local": int(re.search(r"LOCAL:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
        "warps": kernel.metadata.num_warps, "mma": mma, "ldgsts128": cp_async,
        "tma": len(re.findall(r"UTMALDG", sass)), "pdl": kernel.metadata.launch_pdl,
        "ptx_memory_before_wait": memory_before_wait(kernel.asm["ptx"])}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_script(BUILD + COMPILE)


@pytest.mark.parametrize(
    "mask, cache",
    [
        ("visibility", "contiguous"),
        ("visibility", "paged"),
        ("bits", "contiguous"),
        ("causal", "contiguous"),
        ("ones", "contiguous"),
        ("gather", "paged"),
        ("gather-bits", "paged"),
        ("gather-device", "paged"),
    ],
)
def test_hopper_kernel_builds_as_designed(compiled, mask, cache):
    got = compiled[f"{mask}-{cache}"]
    assert got["shared"] <= MAX_SHARED, got
    assert got["local"] == 0, f"register spills: {got}"
    # a few spilled scalars at most: 255 registers hold the accumulators; a spill of the tensor-core
    # operands' shared-memory descriptors makes the kernel markedly slower
    assert got["stack"] <= 64, f"register spills: {got}"
    # warpgroup 0: the whole 64 x 64 score tile ((512 + 64) / 16 = 36 products) and P V over the first
    # latent half (4); warpgroup 1 (the worker partition): P V over the second half (4); 8 warps in all
    assert got["mma"] == {"64x64x16": 36, "64x256x16": 8}, got["mma"]
    assert got["warps"] == 8, got
    if mask.startswith("gather"):
        # pages of any size: every copy a 16-byte cp.async (none split into narrower ones), no TMA
        assert got["ldgsts128"] > 0 and got["tma"] == 0, got
    else:
        assert got["tma"] > 0 and got["ldgsts128"] == 0, got


def test_hopper_kernel_waits_first_under_pdl(compiled):
    """Launched with PDL, the kernel's first memory access comes after griddepcontrol.wait (the
    predecessor's writes visible, its reads done); without PDL the wait is compiled out."""
    got = compiled["pdl-contiguous"]
    assert got["pdl"] is True and got["ptx_memory_before_wait"] == 0, got
    assert got["mma"] == compiled["visibility-contiguous"]["mma"] and got["local"] == 0, got
    assert compiled["visibility-contiguous"]["ptx_memory_before_wait"] == -1
