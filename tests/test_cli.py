"""The command line: the demo runs, golden bundles check out, unknown input is refused."""

import pytest

from kdtree_engine.cli import main


def test_tree_demo_prints_tree_and_mask(capsys):
    assert main(["tree", "--demo", "--budget", "6", "--depth", "3", "--vocab", "9"]) == 0
    out = capsys.readouterr().out
    assert "6 nodes" in out and "[0] root" in out and "visibility" in out and "accept" in out


def test_golden_check_passes(capsys):
    assert main(["golden", "--check"]) == 0
    out = capsys.readouterr().out
    assert "] tree_random_fp32: ok (" in out and "bundles match the reference" in out  # one line per bundle


def test_golden_compare_tolerates_last_bits_only():
    """A bundle recomputed on another CPU may differ in the last bits of its floats; a real change, a
    NaN moved, or an integer off by one is still a difference."""
    import torch

    from kdtree_engine.golden.cli import _same

    x = torch.randn(64, dtype=torch.float32)
    assert _same(x, x.clone())
    assert _same(x, x + 4.8e-7 * x.abs())
    assert not _same(x, x + 1e-3)
    nan = x.clone()
    nan[3] = float("nan")
    assert _same(nan, nan.clone())
    assert not _same(nan, x)
    assert not _same(torch.arange(5), torch.arange(5) + torch.tensor([0, 0, 1, 0, 0]))
    assert not _same(x, x.double())


def test_unknown_command_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'no-such-command'" in err and "--help" in err


def test_golden_with_a_missing_folder_is_refused(tmp_path, capsys):
    assert main(["golden", "--check", "--dir", str(tmp_path / "nowhere")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "--dir" in out.err


BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoTriton())
from kdtree_engine.cli import build_parser

build_parser().parse_args(["generate", "--demo"])
print("parsed")
"""


def test_the_command_line_builds_without_triton():
    """The README's main command installs no triton (the [gpu] extra): building the parser imports every
    subcommand's arguments, bench modules included, so none may import triton at module level."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", BLOCK_TRITON], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "parsed" in run.stdout, run.stderr[-2000:]
