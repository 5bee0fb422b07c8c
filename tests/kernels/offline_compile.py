"""Offline compiles for sm_90 on any machine: runs a script that builds kernels with Triton's compiler for
a Hopper target (no GPU needed: Triton's own ptxas / cuobjdump) and prints a JSON object last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)

# The start of a compile script: build(fn, sig, cst, warps, stages) compiles a kernel for sm_90 and
# returns resources(kernel): its shared memory, local (spilled) bytes and registers per thread;
# i32(*names) types ints; memory_before_wait(ptx) counts the memory accesses a PDL kernel makes
# before its wait.
# Pointers are 16-byte aligned and every int the kernel lets Triton specialize is a multiple of 16, as
# a launch at realistic sizes marks them (the marks decide load widths and software pipelining, hence
# the shared memory); launch_compile.py compiles kernels exactly as the package launches them.
BUILD = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def build(fn, sig, cst, warps=4, stages=3):
    names, loose = list(sig), set(getattr(fn, "do_not_specialize", ()))
    marked = [n for n in names if n.endswith("_ptr") or (sig[n] == "i32" and n not in loose)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in marked}
    sig = dict(sig, **{n: "constexpr" for n in cst})
    kernel = triton.compile(ASTSource(fn, sig, cst, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    return resources(kernel)


def resources(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return {"shared": kernel.metadata.shared, "local": int(re.search(r"LOCAL:(\d+)", res).group(1)),
            "regs": int(re.search(r"REG:(\d+)", res).group(1))}


def i32(*names):
    return {n: "i32" for n in names}


def memory_before_wait(ptx):
    # global / shared memory accesses and async copies in the PTX text before griddepcontrol.wait (the
    # wait a kernel launched with PDL runs first, kernels/_pdl.py); -1: no wait at all
    at = ptx.find("griddepcontrol.wait")
    return -1 if at < 0 else len(re.findall(r"\b(ld|st|cp\.async|red|atom)\.[\w.]*(global|shared)", ptx[:at]))
"""


def run_compile_script(script: str) -> dict:
    """The JSON object that `script` prints on its last line, run in a fresh interpreter with the Triton
    interpreter off and this checkout's src first on the path; skips when Triton ships no ptxas."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no ptxas / cuobjdump")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
