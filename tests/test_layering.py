"""The kernels import nothing from the public op modules (no import circle): every kernels module,
imported in a fresh interpreter, loads no module of the public ops, the model or the engine."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
KERNELS = sorted(p.stem for p in (SRC / "kdtree_engine/kernels").glob("[!_]*.py"))
PUBLIC = ("kdtree_engine.attention", "kdtree_engine.tree", "kdtree_engine.model", "kdtree_engine.engine")


def test_kernel_modules_import_no_public_op_module():
    code = (
        "import sys, importlib\n"
        f"for name in {KERNELS!r}:\n"
        "    importlib.import_module('kdtree_engine.kernels.' + name)\n"
        f"print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in {PUBLIC!r})))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the kernels import {out.stdout.strip()}"
    assert {"mla_attention_hopper", "mla_attention_triton", "tree_topk"} <= set(KERNELS)
