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
