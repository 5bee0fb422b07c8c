"""Smoke test of `kdtree-engine bench tree` at tiny settings (CPU: kernels through the interpreter)."""

from __future__ import annotations

import json

from kdtree_engine.cli import main


def test_bench_tree_smoke(tmp_path):
    argv = ["bench", "tree", "--batch", "2", "--depth", "2", "--budgets", "3", "--vocab", "40"]
    argv += ["--out", str(tmp_path), "--host-iters", "1", "--iters", "3", "--graph-calls", "2"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "tree_bench.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["exact vs ref"]
    assert "| B | budget |" in (tmp_path / "tree_bench.md").read_text()
