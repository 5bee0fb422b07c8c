"""The README's Python examples run as written (on the CPU, with the shipped kimi-nano), and the CI script
runs the README's test command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_its_examples():
    blocks = python_blocks()
    assert len(blocks) >= 2 and any("generate(" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_example_runs(index, capsys):
    exec(compile(python_blocks()[index], f"README.md python block {index}", "exec"), {})


def test_ci_runs_the_readme_test_command_in_a_new_environment():
    """.ci/run reads the one README line that installs the [test] extra and runs pytest, and runs it in a
    venv it creates; this checks the line is there, once, and that the script's extraction finds it."""
    lines = [
        line
        for line in README.splitlines()
        if re.match(r"^python3 -m pip install .* && python3 -m pytest", line)
    ]
    assert len(lines) == 1 and '".[test]"' in lines[0] and "constraints.txt" in lines[0]
    script = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in script and "README.md" in script
    found = subprocess.run(
        ["bash", "-c", re.search(r"^command=\$\((.*)\)$", script, re.M).group(1)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert found == lines[0]
