"""The command line: the demo runs, golden bundles check out, unknown input is refused."""

import pytest

from kdtree_engine.cli import main


def test_tree_demo_prints_tree_and_mask(capsys):
    assert main(["tree", "--demo", "--budget", "6", "--depth", "3", "--vocab", "9"]) == 0
    out = capsys.readouterr().out
    assert "6 nodes" in out and "[0] root" in out and "visibility" in out and "accept" in out


def test_golden_check_passes():
    assert main(["golden", "--check"]) == 0


def test_unknown_command_exits_nonzero():
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_golden_with_a_missing_folder_is_refused(tmp_path, capsys):
    assert main(["golden", "--check", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "--dir" in capsys.readouterr().out
