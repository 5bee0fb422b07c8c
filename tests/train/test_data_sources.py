"""`kdtree-engine train data --packages`: installed distributions join the standard library's files,
deduplicated by content, split by path, capped in tokens, reproducible to the byte (CPU, tiny corpora)."""

from __future__ import annotations

import json
import random
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from kdtree_engine.cli import main
from kdtree_engine.train.corpus_sources import (
    MAX_PACKAGE_FILE_BYTES,
    PINNED_PACKAGES,
    license_of,
    package_names,
    package_source,
)
from kdtree_engine.train.data import (
    CorpusConfig,
    is_heldout,
    load_tokens,
    prepare_corpus,
    read_manifest,
    take_within,
)
from tests.train.test_data_target import _fake_stdlib

ROOT = Path(__file__).parents[2]


def _module(name: str, n: int) -> str:
    return f'"""{name}."""\n' + "".join(f"\n\ndef {name}_{j}(x):\n    return x + {j}\n" for j in range(n))


def _fake_distribution(site: Path, name: str, version: str, files: dict[str, str], meta: list[str]) -> None:
    """A distribution as a wheel installs it: the files, and a .dist-info with METADATA and RECORD."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("\n".join([f"Name: {name}", f"Version: {version}", *meta]) + "\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in [*files, f"{info.name}/METADATA"]))


def _fake_site(site: Path, stdlib: Path) -> Path:
    """fakepkg (a duplicate inside it, one of a stdlib module, a test suite, vendored code, a huge file,
    a non-.py file) and otherpkg (license only in classifiers, a multi-line License text)."""
    core = _module("core", 12)
    files = {
        "fakepkg/__init__.py": "VERSION = '1.0'\n",
        "fakepkg/core.py": core,
        "fakepkg/copy_of_core.py": core,
        "fakepkg/mod0_again.py": (stdlib / "mod0.py").read_text(),
        "fakepkg/tests/test_core.py": _module("test_core", 3),
        "fakepkg/_vendor/six.py": _module("six", 3),
        "fakepkg/table.py": "T = [" + "0, " * (MAX_PACKAGE_FILE_BYTES // 3) + "]\n",
        "fakepkg/data.txt": "not python\n",
    }
    files.update({f"fakepkg/sub/m{i}.py": _module(f"m{i}", 10 + i) for i in range(8)})
    _fake_distribution(site, "fakepkg", "1.0", files, ["License-Expression: MIT"])
    other = {"otherpkg/__init__.py": _module("other", 6)}
    meta = ["License: Copyright (c) someone", " all rights granted"]  # a license text: not one line
    meta.append("Classifier: License :: OSI Approved :: BSD License")
    _fake_distribution(site, "otherpkg", "2.1", other, meta)
    return site


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    stdlib = _fake_stdlib(tmp_path_factory.mktemp("stdlib"))
    return stdlib, _fake_site(tmp_path_factory.mktemp("site"), stdlib)


def _config(trees, out, **kwargs) -> CorpusConfig:
    stdlib, site = trees
    base = dict(vocab_size=300, heldout_every=3, num_prompts=2, prompt_lines=3, stdlib=str(stdlib))
    return CorpusConfig(out=str(out), site_packages=str(site), **{**base, **kwargs})


@pytest.fixture(scope="module")
def broad(trees, tmp_path_factory):
    cfg = _config(trees, tmp_path_factory.mktemp("broad"), packages=("fakepkg", "otherpkg"), dedup=True)
    return cfg, prepare_corpus(cfg)


def test_sources_licenses_and_skipped_files_are_recorded(broad):
    _, out = broad
    m = read_manifest(out)
    sources = {s["name"]: s for s in m["sources"]}
    assert list(sources) == ["stdlib", "fakepkg", "otherpkg"]
    stdlib, fake, other = sources["stdlib"], sources["fakepkg"], sources["otherpkg"]
    assert (stdlib["license"], fake["license"]) == ("PSF-2.0", "MIT")
    assert fake["license_from"] == "License-Expression"
    assert (other["license"], other["license_from"]) == ("BSD License", "Classifier")
    assert (fake["version"], other["version"]) == ("1.0", "2.1")
    assert fake["skipped"] == {"test suite": 1, "vendored": 1, f"over {MAX_PACKAGE_FILE_BYTES} bytes": 1}
    assert fake["files"] == 12 and other["files"] == 1
    files = m["files"]["train"] + m["files"]["heldout"]
    assert "fakepkg-1.0/fakepkg/sub/m3.py" in files and "otherpkg-2.1/otherpkg/__init__.py" in files
    assert not [f for f in files if "tests/" in f or "_vendor" in f or "table.py" in f or f.endswith(".txt")]


def test_dedup_keeps_the_first_in_path_order_and_counts_per_source(broad):
    _, out = broad
    m = read_manifest(out)
    dedup = m["dedup"]
    assert dedup["enabled"] and dedup["files_dropped"] == 2
    assert dedup["dropped"] == [
        ["fakepkg-1.0/fakepkg/core.py", "fakepkg-1.0/fakepkg/copy_of_core.py"],
        ["mod0.py", "fakepkg-1.0/fakepkg/mod0_again.py"],
    ]
    assert {s["name"]: s["duplicates"] for s in m["sources"]} == {"stdlib": 1, "fakepkg": 1, "otherpkg": 0}
    files = m["files"]["train"] + m["files"]["heldout"]
    assert "mod0.py" not in files and "fakepkg-1.0/fakepkg/copy_of_core.py" in files and len(set(files)) == 24


def test_split_is_by_path_and_written_in_path_order(broad):
    cfg, out = broad
    m = read_manifest(out)
    assert m["files"]["heldout"] and all(is_heldout(f, 3) for f in m["files"]["heldout"])
    assert not any(is_heldout(f, 3) for f in m["files"]["train"])
    assert m["files"]["train"] == sorted(m["files"]["train"])
    ids = np.asarray(load_tokens(out, "train"))
    assert int(np.count_nonzero(ids == m["eos_token_id"])) == len(m["files"]["train"])


def test_adding_packages_keeps_the_stdlib_split(trees, broad, tmp_path):
    _, out = broad
    alone = read_manifest(prepare_corpus(_config(trees, tmp_path)))
    m = read_manifest(out)
    assert alone["dedup"] == {"enabled": False, "files_dropped": 0, "bytes_dropped": 0, "dropped": []}
    for split in ("train", "heldout"):
        stdlib_files = [f for f in m["files"][split] if "/" not in f or f.startswith("pkg/")]
        assert stdlib_files == [f for f in alone["files"][split] if f != "mod0.py"]


def test_corpus_with_packages_is_reproducible_to_the_byte(trees, broad, tmp_path):
    cfg, out = broad
    again = prepare_corpus(CorpusConfig(**{**cfg.__dict__, "out": str(tmp_path)}))
    for name in ("train.bin", "heldout.bin", "tokenizer.json", "heldout_prompts.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    first, second = read_manifest(out), read_manifest(again)
    first["config"].pop("out"), second["config"].pop("out")
    assert first == second


def test_train_cap_keeps_whole_files_within_the_budget(trees, broad, tmp_path):
    from tokenizers import Tokenizer

    _, full = broad
    total = read_manifest(full)["tokens"]["train"]
    half = total // 2
    out = prepare_corpus(_config(trees, tmp_path, packages=("fakepkg",), dedup=True, max_train_tokens=half))
    m = read_manifest(out)
    cap = m["caps"]["train"]
    assert cap["max_tokens"] == half and 0 < cap["tokens"] <= half and cap["files"] < cap["files_before"]
    assert m["caps"]["heldout"]["files"] == m["caps"]["heldout"]["files_before"]  # not capped
    ids = np.asarray(load_tokens(out, "train"))
    assert ids.size == cap["tokens"] == m["tokens"]["train"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    docs = np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]
    stdlib, site = trees
    paths = [stdlib / f if "-1.0/" not in f else site / f.split("/", 1)[1] for f in m["files"]["train"]]
    assert [tok.decode(d[:-1].tolist()) for d in docs] == [p.read_text() for p in paths]  # whole files


def test_take_within_is_seeded_and_stops_at_the_first_file_that_does_not_fit():
    sizes = [5, 3, 8, 2, 7, 4]
    assert take_within(sizes, None, "0-train") == list(range(6))
    assert take_within(sizes, sum(sizes), "0-train") == list(range(6))
    order = list(range(6))
    random.Random("0-train").shuffle(order)  # the seeded order: a prefix of it is taken
    for cap in range(1, sum(sizes)):
        taken = take_within(sizes, cap, "0-train")
        k = len(taken)
        assert taken == sorted(order[:k]) and sum(sizes[i] for i in taken) <= cap
        assert k == 6 or sum(sizes[i] for i in taken) + sizes[order[k]] > cap
    picks = {tuple(take_within(sizes, 12, f"{seed}-train")) for seed in range(20)}
    assert len(picks) > 1  # the seed changes the order


def test_caps_that_keep_no_file_name_their_argument(trees, tmp_path):
    with pytest.raises(ValueError, match="max_heldout_tokens: 2 is below"):
        prepare_corpus(_config(trees, tmp_path, max_heldout_tokens=2))
    with pytest.raises(ValueError, match="max_train_tokens"):
        _config(trees, tmp_path, max_train_tokens=0)
    with pytest.raises(ValueError, match="packages"):
        _config(trees, tmp_path, packages=("",))


def test_a_real_package_is_read_from_its_installed_distribution():
    version = metadata.version("iniconfig")  # installed with pytest
    source, files = package_source("iniconfig", None)
    assert source.version == version and source.license != "unknown" and files
    assert all(f.rel.startswith(f"iniconfig-{version}/iniconfig/") and f.rel.endswith(".py") for f in files)
    assert license_of(metadata.distribution("iniconfig")) == (source.license, source.license_from)


def test_pinned_is_the_constraints_file():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [line.split("==")[0] for line in lines if "==" in line]
    assert list(PINNED_PACKAGES) == pins
    names = package_names(("numpy", "pinned", "iniconfig"))
    assert names == ["numpy", *[p for p in pins if p != "numpy"], "iniconfig"]


def test_cli_builds_with_packages_and_refuses_an_unknown_one(trees, tmp_path, capsys):
    stdlib, site = trees
    base = ["train", "data", "--stdlib", str(stdlib), "--site-packages", str(site), "--vocab-size", "300"]
    base += ["--heldout-every", "3", "--num-prompts", "2", "--prompt-lines", "3"]
    rc = main([*base, "--out", str(tmp_path / "ok"), "--packages", "otherpkg", "fakepkg", "--dedup"])
    out = capsys.readouterr().out
    assert rc == 0 and "otherpkg 2.1 (1 files)" in out and "2 duplicate files dropped" in out
    assert read_manifest(tmp_path / "ok")["config"]["packages"] == ["otherpkg", "fakepkg"]
    rc = main([*base, "--out", str(tmp_path / "bad"), "--packages", "fakepkg", "no-such-dist"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    message = "kdtree-engine train data: packages: no installed distribution named 'no-such-dist' in"
    assert err.startswith(f"{message} {site}")
    assert not (tmp_path / "bad").exists()
    assert json.loads((tmp_path / "ok" / "heldout_prompts.json").read_text())["prompts"]
