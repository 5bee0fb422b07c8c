"""The kimi-nano corpus: Python source, tokenized by a byte-level BPE.

`prepare_corpus` reads every `.py` file of the running interpreter's standard library (PSF license;
present on every machine with Python, so no download) and, with `packages`, the `.py` files of installed
distributions (corpus_sources.py says which files and how their paths are named). It splits the files
into train and held-out by a hash of their path, trains a byte-level BPE with `tokenizers` on the train
files only, and writes into one folder:

    tokenizer.json         the BPE (special tokens <|endoftext|> = 0 and <|mask|> = 1)
    train.bin, heldout.bin flat uint16 token ids, each file followed by <|endoftext|>, in path order
    heldout_prompts.json   code-completion prompts cut from held-out files (text)
    manifest.json          vocabulary, special ids, token counts, the Python version, every source's
                           version and license, the duplicates dropped, the caps and the file lists

Options beyond the default (stdlib only, every file, no cap; the corpus of the shipped weights):
- dedup: files with identical text (sha256) are kept once, the first in sorted path order, before the
  split, so that no text is both trained on and held out;
- max_train_tokens / max_heldout_tokens: a split keeps whole files taken in a seeded order (each split
  its own) until the next file would pass the cap; the BPE is still trained on the whole train split.

The same Python version, the same package versions and the same arguments give the same bytes. Another
Python version reads another standard library: the manifest records which one and which packages.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kdtree_engine.train.corpus_sources import (
    PINNED,
    Source,
    SourceFile,
    package_names,
    package_source,
    stdlib_source,
)

EOS = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, MASK)
ENCODE_BATCH = 512  # files per tokenizers.encode_batch call (bounds the Encoding objects held at once)


@dataclass(frozen=True)
class CorpusConfig:
    """What `prepare_corpus` builds. heldout_every: one file in N (by path hash) is held out.
    packages: installed distributions whose .py files join the standard library's (`pinned`: the
    README's pinned packages), searched for in `site_packages` (default: this interpreter's sys.path).
    dedup, max_train_tokens, max_heldout_tokens: see the module docstring."""

    out: str = "data/kimi-nano"
    vocab_size: int = 8192
    heldout_every: int = 40
    num_prompts: int = 32
    prompt_lines: int = 12
    seed: int = 0
    stdlib: str | None = None  # default: this interpreter's standard library
    packages: tuple[str, ...] = ()
    site_packages: str | None = None
    dedup: bool = False
    max_train_tokens: int | None = None
    max_heldout_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) or self.vocab_size > 65536:
            raise ValueError(f"vocab_size: expected 258..65536 (uint16 ids), got {self.vocab_size}")
        if self.heldout_every < 2:
            raise ValueError(f"heldout_every: expected >= 2, got {self.heldout_every}")
        if self.num_prompts < 1 or self.prompt_lines < 1:
            raise ValueError("num_prompts, prompt_lines: expected >= 1")
        for name in ("max_train_tokens", "max_heldout_tokens"):
            cap = getattr(self, name)
            if cap is not None and cap < 1:
                raise ValueError(f"{name}: expected >= 1 or none, got {cap}")
        if not isinstance(self.packages, tuple) or not all(isinstance(p, str) and p for p in self.packages):
            raise ValueError(f"packages: expected a tuple of distribution names, got {self.packages!r}")


def is_heldout(rel_path: str, every: int) -> bool:
    """A stable split by file: the first 8 bytes of sha256(path) modulo `every` == 0."""
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little") % every == 0


def gather_files(cfg: CorpusConfig) -> tuple[list[Source], list[SourceFile]]:
    """The sources (the standard library, then the packages in the order named) and all their files,
    sorted by path."""
    root = Path(cfg.stdlib) if cfg.stdlib else Path(sysconfig.get_paths()["stdlib"])
    source, files = stdlib_source(root)
    sources = [source]
    for name in package_names(cfg.packages):
        source, more = package_source(name, cfg.site_packages)
        sources.append(source)
        files += more
    return sources, sorted(files, key=lambda f: f.rel)


def deduplicate(files: list[SourceFile]) -> tuple[list[SourceFile], list[tuple[SourceFile, SourceFile]]]:
    """The files whose text (sha256) was not seen earlier in their order, and (dropped, kept) pairs for
    the others."""
    first: dict[bytes, SourceFile] = {}
    kept, dropped = [], []
    for f in files:
        digest = hashlib.sha256(f.text.encode()).digest()
        if digest in first:
            dropped.append((f, first[digest]))
        else:
            first[digest] = f
            kept.append(f)
    return kept, dropped


def dedup_record(sources: list[Source], dropped: list[tuple[SourceFile, SourceFile]], enabled: bool) -> dict:
    """The manifest's account of deduplication; sets each source's `duplicates` count."""
    for source in sources:
        source.duplicates = sum(1 for f, _ in dropped if f.source == source.name)
    return {
        "enabled": enabled,
        "files_dropped": len(dropped),
        "bytes_dropped": sum(len(f.text.encode()) for f, _ in dropped),
        "dropped": [[f.rel, same.rel] for f, same in dropped],
    }


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) with SPECIAL_TOKENS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_files(tok, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids as a uint16 array followed by <|endoftext|>, encoded ENCODE_BATCH texts at a time."""
    eos = tok.token_to_id(EOS)
    docs = []
    for start in range(0, len(texts), ENCODE_BATCH):
        for enc in tok.encode_batch(texts[start : start + ENCODE_BATCH]):
            docs.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return docs


def take_within(sizes: list[int], cap: int | None, seed: str) -> list[int]:
    """The indices of the files a split keeps under a token cap, in increasing order: all without a cap;
    with one, files in the order of a shuffle seeded by `seed` until the next file would pass the cap."""
    if cap is None:
        return list(range(len(sizes)))
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    taken, total = [], 0
    for i in order:
        if total + sizes[i] > cap:
            break
        taken.append(i)
        total += sizes[i]
    return sorted(taken)


def write_split(
    out: Path, name: str, files: list[SourceFile], docs: list[np.ndarray], cap: int | None, seed: int
) -> tuple[list[SourceFile], dict]:
    """Writes `<name>.bin` from the files kept under the cap; returns them and the manifest's account
    of the cap (ValueError naming the cap's argument when it keeps no file)."""
    keep = take_within([d.size for d in docs], cap, f"{seed}-{name}")
    if not keep:
        raise ValueError(f"max_{name}_tokens: {cap} is below the first file's tokens in the seeded order")
    ids = np.concatenate([docs[i] for i in keep])
    ids.tofile(out / f"{name}.bin")
    record = {"max_tokens": cap, "files_before": len(files), "tokens_before": int(sum(d.size for d in docs))}
    return [files[i] for i in keep], {**record, "files": len(keep), "tokens": int(ids.size)}


def completion_prompts(texts: list[tuple[str, str]], cfg: CorpusConfig) -> list[dict]:
    """Seeded code-completion prompts from held-out files: `prompt_lines` lines ending with a `def`
    line, the model completes the body. The prompt stops before the def line's newline: the BPE merges
    a newline with the next line's indentation, so a prompt ending in a bare newline would be tokenized
    unlike any training text. texts: (relative path, text)."""
    rng = random.Random(cfg.seed)
    candidates = []
    for rel, text in texts:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i >= cfg.prompt_lines:
                prompt = "".join(lines[i + 1 - cfg.prompt_lines : i + 1]).rstrip("\n")
                candidates.append((rel, prompt))
    rng.shuffle(candidates)
    chosen, per_file = [], {}
    for rel, prompt in candidates:  # at most two prompts per file, for variety
        if per_file.get(rel, 0) < 2:
            chosen.append({"source": rel, "text": prompt})
            per_file[rel] = per_file.get(rel, 0) + 1
        if len(chosen) == cfg.num_prompts:
            break
    return chosen


def prepare_corpus(cfg: CorpusConfig) -> Path:
    """Builds the corpus folder described in the module docstring; returns it."""
    sources, files = gather_files(cfg)
    kept, dropped = deduplicate(files) if cfg.dedup else (files, [])
    dedup = dedup_record(sources, dropped, cfg.dedup)
    splits = {"train": [f for f in kept if not is_heldout(f.rel, cfg.heldout_every)]}
    splits["heldout"] = [f for f in kept if is_heldout(f.rel, cfg.heldout_every)]
    if not splits["train"] or not splits["heldout"]:
        raise ValueError(f"stdlib: {cfg.stdlib or 'the standard library'} has too few .py files for a split")
    tok = train_tokenizer([f.text for f in splits["train"]], cfg.vocab_size)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    caps, written = {}, {}
    for name, split in splits.items():
        docs = encode_files(tok, [f.text for f in split])
        cap = getattr(cfg, f"max_{name}_tokens")
        written[name], caps[name] = write_split(out, name, split, docs, cap, cfg.seed)
    prompts = completion_prompts([(f.rel, f.text) for f in written["heldout"]], cfg)
    (out / "heldout_prompts.json").write_text(json.dumps({"prompts": prompts}, indent=1) + "\n")
    manifest = {
        "config": asdict(cfg),
        "python": platform.python_version(),
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": tok.token_to_id(EOS),
        "mask_token_id": tok.token_to_id(MASK),
        "tokens": {name: caps[name]["tokens"] for name in caps},
        "sources": [asdict(s) for s in sources],
        "dedup": dedup,
        "caps": caps,
        "files": {name: [f.rel for f in written[name]] for name in written},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a prepared corpus; ValueError naming the folder when it was not prepared."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"data: {folder} has no manifest.json (prepare it with `kdtree-engine train data`)")
    return json.loads(path.read_text())


def load_tokens(folder: str | Path, split: str) -> np.ndarray:
    """The token ids of one split ("train" or "heldout") as a read-only uint16 memmap."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split: expected 'train' or 'heldout', got {split!r}")
    path = Path(folder) / f"{split}.bin"
    if not path.is_file():
        raise ValueError(f"data: {path} is missing (prepare it with `kdtree-engine train data`)")
    return np.memmap(path, dtype=np.uint16, mode="r")


def add_arguments(parser) -> None:
    from kdtree_engine.train.options import add_config_arguments

    help_texts = {
        "out": "output folder",
        "vocab_size": "BPE vocabulary incl. the special tokens",
        "heldout_every": "hold out one file in N (by path hash)",
        "stdlib": "standard library folder (default: this interpreter's)",
        "seed": "seeds the held-out prompts and the capped splits' file order",
        "site_packages": "folder to find the --packages in (default: this interpreter's sys.path)",
        "dedup": "keep files with identical text once (the first in path order)",
        "max_train_tokens": "keep whole train files, in a seeded order, up to this many tokens",
        "max_heldout_tokens": "keep whole held-out files, in a seeded order, up to this many tokens",
    }
    add_config_arguments(parser, CorpusConfig, help_texts)
    parser.add_argument(
        "--packages",
        nargs="+",
        metavar="NAME",
        default=None,
        help=f"installed distributions whose .py files join the standard library's; {PINNED!r}: the "
        "packages the README pins in constraints.txt (default: none, the stdlib alone)",
    )


def summary(manifest: dict) -> str:
    """The sources and duplicates of a prepared corpus in one line."""
    sources = ", ".join(f"{s['name']} {s['version']} ({s['files']} files)" for s in manifest["sources"])
    return f"sources: {sources}; {manifest['dedup']['files_dropped']} duplicate files dropped"


def main(args) -> int:
    from kdtree_engine.train.options import config_from_args

    out = prepare_corpus(config_from_args(CorpusConfig, args))
    m = read_manifest(out)
    tokens = m["tokens"]
    print(f"{out}: {tokens['train']} train / {tokens['heldout']} held-out tokens, vocab {m['vocab_size']}")
    print(summary(m))
    return 0
