"""install() / the plug-in on a stand-in SGLang tree (written per test; the port's real ddtree_utils.py is
used when KDTREE_SGLANG_DDTREE names a checkout), each run in a fresh interpreter."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import tomllib

from kdtree_engine.integrations import sglang as ours
from kdtree_engine.integrations.sglang import plugin

SRC = Path(__file__).parents[2] / "src"


def stand_in_utils(skip: str = "", rename: str = "") -> str:
    """A ddtree_utils.py whose functions have the port's names and our parameters (minus `skip`; the
    first parameter of `rename` renamed)."""
    lines = ["import torch", ""]
    for name in plugin.FUNCTIONS:
        if name == skip:
            continue
        sig = str(inspect.signature(getattr(ours, name)))
        if name == rename:
            first = next(iter(inspect.signature(getattr(ours, name)).parameters))
            sig = sig.replace(first, first + "_v3", 1)
        lines += [f"def {name}{sig}:", "    return 'port'", ""]
    return "\n".join(lines)


WORKER = """from sglang.srt.speculative.ddtree_utils import build_ddtree_tree_gpu, follow_verified_tree_gpu


class DDTreeWorkerV2:
    def _compute_draft_topk_log_probs_and_token_ids(self, hidden_states, lm_head, topk):
        return 'port'
"""

PROBE = """
import json, os, sys
from kdtree_engine.integrations.sglang import plugin
try:
    replaced = plugin.install() if sys.argv[1] == "install" else plugin.load()
except ValueError as exc:
    print(json.dumps({"error": str(exc)})); raise SystemExit(0)
from sglang.srt.speculative import ddtree_utils as u, ddtree_worker_v2 as w
print(json.dumps({"replaced": replaced, "utils": u.build_ddtree_tree_gpu.__module__,
                  "worker_fn": w.follow_verified_tree_gpu.__module__,
                  "method": w.DDTreeWorkerV2._compute_draft_topk_log_probs_and_token_ids.__module__}))
"""


def make_sglang(root: Path, utils: str | None) -> Path:
    spec = root / "sglang" / "srt" / "speculative"
    spec.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", spec):
        (d / "__init__.py").write_text("")
    if utils is not None:
        (spec / "ddtree_utils.py").write_text(utils)
    (spec / "ddtree_worker_v2.py").write_text(WORKER)
    return root


def probe(root: Path, how: str = "install", env: dict | None = None) -> dict:
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join([str(root), str(SRC)])
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, env=environ,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def port_or_stand_in() -> str:
    path = os.environ.get("KDTREE_SGLANG_DDTREE")
    if path:
        return (Path(path) / "python/sglang/srt/speculative/ddtree_utils.py").read_text()
    return stand_in_utils()


def test_install_replaces_functions_imported_names_and_the_method(tmp_path):
    got = probe(make_sglang(tmp_path, port_or_stand_in()))
    assert "error" not in got, got
    assert got["utils"].startswith("kdtree_engine.integrations.sglang")
    assert got["worker_fn"].startswith("kdtree_engine.integrations.sglang")
    assert got["method"] == "kdtree_engine.integrations.sglang.topk"
    assert "sglang.srt.speculative.ddtree_worker_v2.follow_verified_tree_gpu" in got["replaced"]


@pytest.mark.parametrize("how", ["skip", "rename"])
def test_a_different_port_is_a_clear_error(tmp_path, how):
    name = "compile_ddtree_tree"
    got = probe(make_sglang(tmp_path, stand_in_utils(**{how: name})))
    assert name in got["error"] and plugin.PORT_CHECKED in got["error"]


def test_no_sglang_is_a_clear_error(tmp_path):
    got = probe(make_sglang(tmp_path, None))
    assert "cannot import" in got["error"]


def test_the_plug_in_installs_only_when_asked(tmp_path):
    root = make_sglang(tmp_path, stand_in_utils())
    env_off = {plugin.ENV: "0"}
    assert probe(root, "load", env_off)["utils"] == "sglang.srt.speculative.ddtree_utils"
    assert probe(root, "load", {plugin.ENV: "1"})["utils"].startswith("kdtree_engine")


def test_entry_point_is_declared():
    """In pyproject.toml, and in the installed metadata when kdtree-engine is installed (the GPU machine
    runs the tests from the source tree)."""
    want = "kdtree_engine.integrations.sglang.plugin:load"
    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["sglang.srt.plugins"]["kdtree_ddtree"] == want
    found = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert found.get("kdtree_ddtree", want) == want


def test_signatures_match_the_port():
    """Our four tree-path functions take exactly the port's parameters (from its checkout:
    KDTREE_SGLANG_DDTREE)."""
    path = os.environ.get("KDTREE_SGLANG_DDTREE")
    if not path:
        pytest.skip("KDTREE_SGLANG_DDTREE does not name a checkout of the SGLang DDTree port")
    from .port import port_utils

    utils = port_utils()
    for name in plugin.FUNCTIONS:
        assert list(inspect.signature(getattr(utils, name)).parameters) == list(
            inspect.signature(getattr(ours, name)).parameters
        ), name
