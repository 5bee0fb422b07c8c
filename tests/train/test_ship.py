"""`train ship`: a trained pair into the assets folders: the target's files copied byte for byte, old
weight files gone, the float32 drafter written in bf16 and loadable; missing files, another vocabulary
and bad arguments refused before anything is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.drafter import load_drafter, save_drafter
from kdtree_engine.train.ship import ship


@pytest.fixture()
def trained(tmp_path):
    """The shipped pair as training leaves it: the target folder with a log beside it, the drafter in
    float32."""
    target, drafter = tmp_path / "kimi-nano", tmp_path / "kimi-nano-dflash"
    shutil.copytree(KIMI_NANO, target)
    (target / "train_log.json").write_text("{}")
    save_drafter(load_drafter(KIMI_NANO_DFLASH, dtype=torch.float32), drafter)
    return target, drafter


def test_ship_copies_the_target_and_writes_the_drafter_in_bf16(trained, tmp_path):
    target, drafter = trained
    target_out, drafter_out = tmp_path / "assets" / "kimi-nano", tmp_path / "assets" / "kimi-nano-dflash"
    target_out.mkdir(parents=True)
    (target_out / "model-00009-of-00009.safetensors").write_bytes(b"old shard")
    ship(target, drafter, target_out, drafter_out)
    assert not (target_out / "model-00009-of-00009.safetensors").exists()
    assert not (target_out / "train_log.json").exists()
    for f in KIMI_NANO.iterdir():
        assert (target_out / f.name).read_bytes() == f.read_bytes(), f.name
    assert json.loads((drafter_out / "config.json").read_text()) == json.loads(
        (KIMI_NANO_DFLASH / "config.json").read_text()
    )
    assert (drafter / "model.safetensors").stat().st_size > 1.9 * (
        drafter_out / "model.safetensors"
    ).stat().st_size
    shipped, written = (
        load_file(KIMI_NANO_DFLASH / "model.safetensors"),
        load_file(drafter_out / "model.safetensors"),
    )
    assert shipped.keys() == written.keys()
    for k, v in shipped.items():
        assert written[k].dtype == torch.bfloat16 and torch.equal(written[k], v), k
    load_drafter(drafter_out, dtype=torch.bfloat16)


def test_missing_file_or_other_vocabulary_writes_nothing(trained, tmp_path):
    target, drafter = trained
    out = tmp_path / "out"
    (target / "heldout_prompts.json").unlink()
    with pytest.raises(ValueError, match="heldout_prompts.json is missing"):
        ship(target, drafter, out / "t", out / "d")
    shutil.copyfile(KIMI_NANO / "heldout_prompts.json", target / "heldout_prompts.json")
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    with pytest.raises(ValueError, match="vocab_size 4096, the target 8192"):
        ship(target, drafter, out / "t", out / "d")
    assert not out.exists()


def test_cli_bad_folder_is_one_line_and_exit_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "kdtree_engine", "train", "ship", str(tmp_path / "none"), str(tmp_path / "d")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "config.json is missing" in run.stderr
