"""Packing a prepared corpus for the device and unpacking it there (train/carry.py), on a small synthetic
corpus: byte-identical round trip, a missing or corrupt part named, the command line's errors one line
with exit code 2, and the script that unpacks before training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from kdtree_engine.train.carry import CARRY_LIMIT, PACKED, pack, packed_size, read_packed, run, unpack

ROOT = Path(__file__).resolve().parents[2]


def _corpus(folder: Path) -> Path:
    """A corpus-shaped folder: token files (one of them large enough to need several small parts),
    the tokenizer and manifest as small text files, and an empty file."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    (folder / "train.bin").write_bytes(rng.integers(0, 300, 60_000, dtype=np.uint16).tobytes())
    (folder / "heldout.bin").write_bytes(rng.integers(0, 300, 2_000, dtype=np.uint16).tobytes())
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (folder / "manifest.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": 0}) + "\n")
    (folder / "empty.txt").write_bytes(b"")
    return folder


def _same_files(a: Path, b: Path, names) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture
def packed(tmp_path) -> tuple[Path, Path]:
    corpus = _corpus(tmp_path / "corpus")
    pack(corpus, tmp_path / "packed", part_size=20_000)
    return corpus, tmp_path / "packed"


def test_round_trip_is_byte_identical_in_place_and_elsewhere(packed, tmp_path):
    corpus, folder = packed
    names = sorted(p.name for p in corpus.iterdir())
    record = read_packed(folder)
    train = next(e for e in record["files"] if e["name"] == "train.bin")
    assert len(train["parts"]) > 1 and all(p["size"] <= 20_000 for p in train["parts"])
    assert sorted(unpack(folder, tmp_path / "elsewhere")) == names
    _same_files(corpus, tmp_path / "elsewhere", names)
    assert sorted(unpack(folder)) == names
    _same_files(corpus, folder, names)
    assert unpack(folder) == []  # already there with the packed sha256: kept
    assert packed_size(folder) < sum((corpus / n).stat().st_size for n in names)


def test_packing_is_reproducible_and_replaces_an_earlier_pack(packed, tmp_path):
    corpus, folder = packed
    first = {p.name: p.read_bytes() for p in folder.iterdir()}
    unpack(folder)  # the unpacked files are an earlier pack's too: replaced, not refused
    pack(corpus, folder, part_size=20_000)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == first
    pack(corpus, tmp_path / "again", part_size=20_000)
    assert {p.name: p.read_bytes() for p in (tmp_path / "again").iterdir()} == first


def test_a_missing_part_is_named(packed):
    _, folder = packed
    part = folder / "train.bin.gz.001"
    part.unlink()
    with pytest.raises(ValueError, match=r"train\.bin\.gz\.001 \(part 2 of \d+ of train\.bin\) is missing"):
        unpack(folder)
    assert not (folder / "train.bin").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_part_is_named_and_nothing_is_replaced(packed, damage):
    corpus, folder = packed
    unpack(folder)
    (folder / "train.bin").write_bytes(b"stale")  # a file to be replaced only by a checked one
    part = folder / "train.bin.gz.000"
    data = bytearray(part.read_bytes())
    if damage == "truncate":
        del data[-10:]
    else:
        data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"train\.bin\.gz\.000 \(part 1 of \d+ of train\.bin\) is corrupt"):
        unpack(folder)
    assert (folder / "train.bin").read_bytes() == b"stale"


def test_a_packed_json_that_lies_is_caught_by_the_file_sha256(packed):
    _, folder = packed
    record = read_packed(folder)
    record["files"][0]["sha256"] = "0" * 64
    (folder / PACKED).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="does not match its sha256"):
        unpack(folder)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda tmp: (tmp / "missing", tmp / "out"), "is not a folder"),
        (lambda tmp: (_corpus(tmp / "c"), tmp / "c"), "is the corpus folder itself"),
        (lambda tmp: (_corpus(tmp / "c"), _corpus(tmp / "busy")), "is not empty"),
    ],
)
def test_pack_refuses_bad_folders(tmp_path, setup, message):
    corpus, out = setup(tmp_path)
    with pytest.raises(ValueError, match=message):
        pack(corpus, out)


def test_unpack_refuses_a_folder_that_was_not_packed(tmp_path):
    with pytest.raises(ValueError, match="has no packed.json"):
        unpack(tmp_path)
    (tmp_path / PACKED).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        unpack(tmp_path)


def test_packed_size_counts_what_is_carried(packed):
    _, folder = packed
    on_disk = sum(p.stat().st_size for p in folder.iterdir())
    assert packed_size(folder) == on_disk < CARRY_LIMIT


# ------------------------------------------------------------------------------------ the command line


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = run(list(argv))
    except SystemExit as exc:  # argparse usage errors and --help
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_command_line_packs_and_unpacks(tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus")
    rc, out, err = _cli(capsys, "pack", str(corpus), str(tmp_path / "p"), "--part-mib", "1")
    assert rc == 0 and not err and "fits the 64 MiB" in out
    rc, out, err = _cli(capsys, "unpack", str(tmp_path / "p"))
    assert rc == 0 and not err and "train.bin" in out
    _same_files(corpus, tmp_path / "p", [p.name for p in corpus.iterdir()])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["pack", "{tmp}/nope", "{tmp}/out"], "is not a folder"),
        (["pack", "{tmp}/corpus", "{tmp}/out", "--part-mib", "0"], "--part-mib"),
        (["unpack", "{tmp}/corpus"], "has no packed.json"),
        (["unpack", "{tmp}/broken"], "train.bin.gz.000"),
        (["unpak", "{tmp}"], "invalid choice"),
        (["pack", "{tmp}/corpus"], "required"),
    ],
)
def test_command_line_errors_are_one_line_with_exit_code_2(tmp_path, capsys, argv, words):
    corpus = _corpus(tmp_path / "corpus")
    pack(corpus, tmp_path / "broken")
    (tmp_path / "broken" / "train.bin.gz.000").unlink()
    rc, out, err = _cli(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert rc == 2 and not out and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("python -m kdtree_engine.train.carry") and words in err, err


def test_the_training_script_unpacks_a_packed_data_folder(tmp_path):
    """scripts/train_kimi_nano.sh finds --data and --out in its arguments, unpacks --data before
    training and returns --out as tar parts without the optimizer state; `--help` stands in for the
    training (no GPU here)."""
    corpus = _corpus(tmp_path / "corpus")
    pack(corpus, tmp_path / "packed")
    model = tmp_path / "runs" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "trainer_state.pt").write_bytes(b"moments")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("nvidia-smi", "echo no-gpu"), ("python3", f'exec {sys.executable} "$@"')):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "device")}
    script = ROOT / "scripts" / "train_kimi_nano.sh"
    run_ = subprocess.run(
        ["bash", str(script), "target", f"--data={tmp_path / 'packed'}", "--out", str(model), "--help"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert "unpacked" in run_.stdout and run_.returncode == 0, run_.stdout + run_.stderr
    _same_files(corpus, tmp_path / "packed", [p.name for p in corpus.iterdir()])
    with tarfile.open(tmp_path / "device" / "target.tar.part-aa") as tar:
        assert sorted(tar.getnames()) == ["model", "model/config.json"]


def test_kdtree_engine_train_carry_runs_it(tmp_path, capsys):
    """`kdtree-engine train carry` is this module: a folder without packed.json is one line, exit 2."""
    from kdtree_engine.cli import main

    assert main(["train", "carry", "unpack", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdtree-engine train carry: ") and err.count("\n") == 1 and "packed.json" in err, (
        err
    )
