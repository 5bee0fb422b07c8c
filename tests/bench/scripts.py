"""What the tests of scripts/ share: a script loaded as a module, and its command-line errors checked."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as a module of that name (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_cli_errors(name: str, bad_option: list[str], option: str) -> None:
    """scripts/<name>.py with `bad_option`, and without a GPU (skipped where CUDA is there): one line on
    stderr naming `option`, or saying it needs a CUDA GPU, and exit code 2."""
    for argv, want in ((bad_option, option), ([], "needs a CUDA GPU")):
        if not argv and torch.cuda.is_available():
            continue
        assert_one_line_error(name, argv, want)


def assert_one_line_error(name: str, argv: list[str], want: str) -> None:
    """scripts/<name>.py with `argv`: one line on stderr containing `want`, and exit code 2."""
    run = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *argv], capture_output=True,
                         text=True, timeout=99)  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and want in lines[0], run.stderr
