"""Carrying a prepared corpus to the GPU machine: packed on the CPU, unpacked there byte for byte.

The corpus is built on a CPU machine (`kdtree-engine train data`), where it is reproducible to the
byte; the GPU machine has other package versions and receives only the working tree plus a few named
git-ignored paths of limited total size (CARRY_LIMIT). So the prepared files travel compressed:

- `pack(corpus, out)` writes every file of the corpus folder gzip-compressed (level 9, no name or time
  in the header, so the same corpus packs to the same bytes) and cut into parts of at most `part_size`
  bytes, `NAME.gz.000`, `NAME.gz.001`, ..., plus `packed.json`: each file's size and sha256, and its
  parts' names, sizes and sha256.
- `unpack(folder)` writes the files back into the same folder (or `out`): every part is checked
  against `packed.json` before it is read, every file against its size and sha256 before it replaces
  anything; a missing or corrupt part is a ValueError naming it. A file already there with the right
  sha256 is kept.

The unpacked folder is what `train target` and `train drafter` read (`--data`);
scripts/train_kimi_nano.sh unpacks its `--data` folder when that holds `packed.json`.

Command line: `kdtree-engine train carry pack CORPUS OUT` and `... unpack FOLDER [--out DIR]` (also
`python -m kdtree_engine.train.carry ...`, where the console script is not installed).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path

PACKED = "packed.json"
PART_SIZE = 15 * 2**20  # each part stays under the 16 MiB a device call can return as one file
CARRY_LIMIT = 64 * 2**20  # what one device call carries beside the working tree, all paths together
FORMAT = 1
PROG = "python -m kdtree_engine.train.carry"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _corpus_files(corpus: Path) -> list[Path]:
    """The files of a corpus folder, by name; ValueError for a missing, empty or already packed folder
    or one with subfolders (a prepared corpus has none)."""
    if not corpus.is_dir():
        raise ValueError(f"{corpus} is not a folder (prepare it with `kdtree-engine train data`)")
    if (corpus / PACKED).exists():
        raise ValueError(f"{corpus} is already packed (it holds {PACKED})")
    entries = sorted(corpus.iterdir())
    folders = [p.name for p in entries if not p.is_file()]
    if folders:
        raise ValueError(f"{corpus} holds a subfolder ({folders[0]}); a corpus folder holds files only")
    if not entries:
        raise ValueError(f"{corpus} is empty")
    return entries


def _clear_previous_pack(out: Path) -> None:
    """Removes what an earlier pack into `out` wrote (its parts, the files unpacked from them and its
    packed.json); ValueError when `out` then still holds anything, so a pack never mixes with other
    files."""
    manifest = out / PACKED
    if manifest.is_file():
        for entry in read_packed(out)["files"]:
            for name in [entry["name"], *(part["name"] for part in entry["parts"])]:
                (out / name).unlink(missing_ok=True)
        manifest.unlink()
    left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if left:
        raise ValueError(f"{out} is not empty ({left[0]}); give a new or empty folder")


def _write_parts(out: Path, name: str, packed: bytes, part_size: int) -> list[dict]:
    """`packed` cut into parts of at most part_size bytes, written as NAME.gz.000, ...; their records."""
    parts = []
    for index, start in enumerate(range(0, max(1, len(packed)), part_size)):
        chunk = packed[start : start + part_size]
        part = f"{name}.gz.{index:03d}"
        (out / part).write_bytes(chunk)
        parts.append({"name": part, "size": len(chunk), "sha256": sha256(chunk)})
    return parts


def pack(corpus: str | Path, out: str | Path, part_size: int = PART_SIZE) -> dict:
    """Packs every file of `corpus` into `out` (created; an earlier pack there is replaced); returns
    the packed.json record. The parts are written before packed.json, so an interrupted pack is not
    mistaken for a whole one."""
    corpus, out = Path(corpus), Path(out)
    if part_size < 1:
        raise ValueError(f"part_size: expected >= 1 byte, got {part_size}")
    files = _corpus_files(corpus)
    if out.resolve() == corpus.resolve():
        raise ValueError(f"out {out} is the corpus folder itself; give another folder")
    _clear_previous_pack(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for path in files:
        data = path.read_bytes()
        packed = gzip.compress(data, compresslevel=9, mtime=0)
        parts = _write_parts(out, path.name, packed, part_size)
        entries.append({"name": path.name, "size": len(data), "sha256": sha256(data), "parts": parts})
    record = {"format": FORMAT, "compression": "gzip", "source": str(corpus), "files": entries}
    (out / PACKED).write_text(json.dumps(record, indent=1) + "\n")
    return record


def read_packed(folder: str | Path) -> dict:
    """The packed.json of a packed folder; ValueError naming the folder when it has none or it is not
    one this module wrote."""
    path = Path(folder) / PACKED
    if not path.is_file():
        raise ValueError(f"{folder} has no {PACKED} (pack it with `{PROG} pack`)")
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or "files" not in record:
        raise ValueError(f"{path} is not a packed-corpus record of format {FORMAT}")
    return record


def _read_part(folder: Path, entry: dict, index: int) -> bytes:
    """One part's bytes, checked against its record; ValueError naming the part when it is missing,
    of another size or another sha256."""
    part = entry["parts"][index]
    path = folder / part["name"]
    count = len(entry["parts"])
    where = f"{path} (part {index + 1} of {count} of {entry['name']})"
    if not path.is_file():
        raise ValueError(f"{where} is missing")
    data = path.read_bytes()
    if len(data) != part["size"]:
        raise ValueError(f"{where} is corrupt: {len(data)} bytes, not the {part['size']} packed")
    if sha256(data) != part["sha256"]:
        raise ValueError(f"{where} is corrupt: its sha256 is not the packed part's")
    return data


def _file_matches(path: Path, entry: dict) -> bool:
    """Whether `path` already holds the packed file (same size and sha256)."""
    if not path.is_file() or path.stat().st_size != entry["size"]:
        return False
    return sha256(path.read_bytes()) == entry["sha256"]


def _unpack_file(folder: Path, entry: dict, dest: Path) -> None:
    """One file from its checked parts, written to a temporary name and moved into place once its
    size and sha256 are the packed file's."""
    packed = b"".join(_read_part(folder, entry, i) for i in range(len(entry["parts"])))
    try:
        data = gzip.decompress(packed)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"the parts of {entry['name']} in {folder} are not gzip ({exc})") from None
    if len(data) != entry["size"] or sha256(data) != entry["sha256"]:
        raise ValueError(f"{entry['name']} from {folder} does not match its sha256 in {PACKED}")
    partial = dest.with_name(dest.name + ".unpacking")
    partial.write_bytes(data)
    os.replace(partial, dest)


def unpack(folder: str | Path, out: str | Path | None = None) -> list[str]:
    """Unpacks the packed `folder` into `out` (default: the folder itself); returns the names of the
    files written (a file already there with the packed sha256 is kept and not listed)."""
    folder = Path(folder)
    out = folder if out is None else Path(out)
    record = read_packed(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in record["files"]:
        dest = out / entry["name"]
        if _file_matches(dest, entry):
            continue
        _unpack_file(folder, entry, dest)
        written.append(entry["name"])
    return written


def packed_size(folder: str | Path) -> int:
    """Bytes of the parts and packed.json of a packed folder: what carrying it costs."""
    folder = Path(folder)
    record = read_packed(folder)
    parts = sum(part["size"] for entry in record["files"] for part in entry["parts"])
    return parts + (folder / PACKED).stat().st_size


# ----------------------------------------------------------------------------------- the command line


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pack CORPUS OUT [--part-mib N]` and `unpack FOLDER [--out DIR]`."""
    actions = parser.add_subparsers(dest="action", required=True)
    packing = actions.add_parser("pack", help="pack a prepared corpus folder for the device")
    packing.add_argument("corpus", help="prepared corpus folder (kdtree-engine train data --out)")
    packing.add_argument("out", help="folder for the parts and packed.json (new, empty or an earlier pack)")
    packing.add_argument("--part-mib", type=int, default=PART_SIZE // 2**20, help="largest part, in MiB")
    unpacking = actions.add_parser("unpack", help="unpack a packed folder, checking every sha256")
    unpacking.add_argument("folder", help="folder written by pack")
    unpacking.add_argument("--out", default=None, help="where the files go (default: FOLDER itself)")


def main(args: argparse.Namespace) -> int:
    if args.action == "pack":
        if args.part_mib < 1:
            raise ValueError(f"--part-mib: expected >= 1, got {args.part_mib}")
        record = pack(args.corpus, args.out, args.part_mib * 2**20)
        size, raw = packed_size(args.out), sum(entry["size"] for entry in record["files"])
        parts = sum(len(entry["parts"]) for entry in record["files"])
        fits = "fits" if size <= CARRY_LIMIT else "does not fit"
        files = len(record["files"])
        print(f"{args.out}: {files} files of {_mb(raw)} packed into {parts} parts, {_mb(size)}")
        print(f"{fits} the {CARRY_LIMIT // 2**20} MiB a device call carries")
        return 0
    written = unpack(args.folder, args.out)
    out = args.out or args.folder
    print(f"{out}: unpacked {', '.join(written) if written else 'nothing (every file already there)'}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A usage error as one line on stderr, exit code 2 (as `kdtree-engine` does)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def run(argv: list[str] | None = None) -> int:
    """The command line: bad input (a usage error, a missing or corrupt file) is one line on stderr and
    exit code 2."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except (ValueError, OSError) as exc:
        print(f"{PROG} {args.action}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
