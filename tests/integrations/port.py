"""The SGLang DDTree port's own code, from a checkout named by KDTREE_SGLANG_DDTREE (never vendored here):
tests that compare with it are skipped when the variable is unset."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kdtree_engine.bench.peers import SGLANG_FILE, SGLANG_TRITON_FILE, _exec_file

ENV = "KDTREE_SGLANG_DDTREE"


def port_dir() -> Path:
    """The checkout (or .peers/sglang as scripts/fetch_peers.sh writes it); skips the test when unset."""
    path = os.environ.get(ENV)
    if not path:
        pytest.skip(f"{ENV} does not name a checkout of the SGLang DDTree port")
    return Path(path)


def port_utils():
    """The port's python/sglang/srt/speculative/ddtree_utils.py (imports numpy and torch only)."""
    return _exec_file(port_dir() / SGLANG_FILE, "_port_ddtree_utils", {}, stable_topk=False)


def port_triton():
    """The port's python/sglang/kernels/ops/speculative/ddtree.py (imports torch and triton only)."""
    return _exec_file(port_dir() / SGLANG_TRITON_FILE, "_port_ddtree_triton", {}, stable_topk=False)
