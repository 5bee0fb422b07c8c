"""Where the kimi-nano corpus's files come from: the standard library and, optionally, installed packages.

Every file is a `SourceFile`: a relative path (the key of the train/held-out split and of the sorted
order), its text and the source it came from. The standard library's paths are relative to its folder
(`asyncio/tasks.py`), as they have always been, so that the default corpus keeps its split. A package's
paths are relative to its site-packages folder and prefixed with the distribution's name and version
(`numpy-2.4.6/numpy/ma/core.py`): two packages cannot collide and a pinned version always splits the
same way.

A package's files are the `.py` files its installed distribution lists (`importlib.metadata`, the
wheel's RECORD), less
- its test suites (files under a folder named `tests` or `test`): repetitive assertions about the
  package rather than the package's code;
- vendored code (files under a folder whose name contains `vendor`): another project's code under
  another license than the distribution's, which the manifest could not name;
- files over MAX_PACKAGE_FILE_BYTES: generated tables and the like;
- files that are not UTF-8 or hold only whitespace (as for the standard library).

`Source` describes one source for the manifest: its version, its license and how many files it gave.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "idlelib/Icons")
# The packages that the README's commands install at a pinned version (constraints.txt, in its order).
PINNED_PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "safetensors",
    "tokenizers",
    "hypothesis",
    "pytest",
    "matplotlib",
    "ruff",
)
PINNED = "pinned"  # the word for PINNED_PACKAGES on the command line
MAX_PACKAGE_FILE_BYTES = 500_000
TEST_DIRS = ("tests", "test")
STDLIB_LICENSE = "PSF-2.0"


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus: `rel` is its path in the corpus (split key and sort key)."""

    rel: str
    text: str
    source: str


@dataclass
class Source:
    """One source of the corpus as the manifest records it. license_from: the metadata field (or
    classifiers) the license was read from. files/bytes: what it gave (before deduplication); skipped:
    why others were not; duplicates: how many of its files deduplication dropped."""

    name: str
    version: str
    license: str
    license_from: str
    files: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None when it is not (a few test files are deliberately not)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files under root, sorted by relative path (installed packages and
    caches excluded)."""
    if not root.is_dir():
        raise ValueError(f"stdlib: {root} is not a folder")
    files = [p for p in root.rglob("*.py") if not any(s in p.relative_to(root).as_posix() for s in SKIP_DIRS)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_source(root: Path) -> tuple[Source, list[SourceFile]]:
    """The standard library under root: its non-empty UTF-8 .py files, paths relative to root."""
    source = Source("stdlib", platform.python_version(), STDLIB_LICENSE, "CPython's license (PSF)")
    files = []
    for path in stdlib_files(root):
        text = read_text(path)
        if text and text.strip():
            files.append(SourceFile(path.relative_to(root).as_posix(), text, source.name))
        else:
            source.skip("not UTF-8 or empty")
    source.files, source.bytes = len(files), sum(len(f.text.encode()) for f in files)
    return source, files


def package_names(packages: tuple[str, ...]) -> list[str]:
    """The distribution names asked for, with the word `pinned` expanded to PINNED_PACKAGES, each once
    in the order given."""
    names: list[str] = []
    for name in packages:
        for n in PINNED_PACKAGES if name == PINNED else (name,):
            if n not in names:
                names.append(n)
    return names


def find_distribution(name: str, site: str | None) -> metadata.Distribution:
    """The installed distribution `name`, searched for in `site` (a folder) or else on sys.path;
    ValueError naming the argument when it is not installed or lists no files."""
    found = metadata.distributions(name=name, path=[site]) if site else metadata.distributions(name=name)
    dist = next(iter(found), None)
    where = site or "this interpreter's sys.path"
    if dist is None:
        raise ValueError(f"packages: no installed distribution named {name!r} in {where}")
    if dist.files is None:
        raise ValueError(f"packages: {name} {dist.version} lists no files (no RECORD: not from a wheel)")
    return dist


def license_of(dist: metadata.Distribution) -> tuple[str, str]:
    """(license, the field it was read from): License-Expression; else a one-line License field; else
    the license classifiers; else "unknown". A multi-line License field is the license's whole text, of
    which the first line rarely names it."""
    meta = dist.metadata
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return expression, "License-Expression"
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and text.upper() != "UNKNOWN":
        return text, "License"
    classifiers = [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(c.split(" :: ")[-1] for c in classifiers), "Classifier"
    return "unknown", "none"


def package_skip_reason(parts: tuple[str, ...], path: Path) -> str | None:
    """Why a package's .py file (parts: its path relative to site-packages) is left out, or None."""
    folders = parts[:-1]
    if ".." in folders or "__pycache__" in folders:
        return "outside the package"
    if any(p in TEST_DIRS for p in folders):
        return "test suite"
    if any("vendor" in p for p in folders):
        return "vendored"
    if path.stat().st_size > MAX_PACKAGE_FILE_BYTES:
        return f"over {MAX_PACKAGE_FILE_BYTES} bytes"
    return None


def package_source(name: str, site: str | None) -> tuple[Source, list[SourceFile]]:
    """The installed distribution `name`: its .py files as described in the module docstring, paths
    prefixed with `<name>-<version>/`, sorted by path."""
    dist = find_distribution(name, site)
    dist_name, version = dist.metadata["Name"], dist.version
    source = Source(dist_name, version, *license_of(dist))
    prefix = f"{dist_name}-{version}/"
    files = []
    for package_path in sorted(dist.files, key=lambda p: p.as_posix()):
        if package_path.suffix != ".py":
            continue
        path = Path(dist.locate_file(package_path))
        reason = package_skip_reason(package_path.parts, path) if path.is_file() else "missing"
        text = None if reason else read_text(path)
        if reason is None and not (text and text.strip()):
            reason = "not UTF-8 or empty"
        if reason:
            source.skip(reason)
            continue
        files.append(SourceFile(prefix + package_path.as_posix(), text, dist_name))
    source.files, source.bytes = len(files), sum(len(f.text.encode()) for f in files)
    return source, files
