"""The kimi-nano corpus: the Python standard library's own source, tokenized by a byte-level BPE.

`prepare_corpus` reads every `.py` file of the running interpreter's standard library (PSF license;
present on every machine with Python, so no download), splits the files into train and held-out by a
hash of their relative path, trains a byte-level BPE with `tokenizers` on the train files only, and
writes into one folder:

    tokenizer.json         the BPE (special tokens <|endoftext|> = 0 and <|mask|> = 1)
    train.bin, heldout.bin flat uint16 token ids, each file followed by <|endoftext|>
    heldout_prompts.json   code-completion prompts cut from held-out files (text)
    manifest.json          vocabulary, special ids, token counts, the Python version and file lists

The same Python version and the same arguments give the same bytes. A different Python version reads a
different standard library: the manifest records which one was used.
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

EOS = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, MASK)
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "idlelib/Icons")


@dataclass(frozen=True)
class CorpusConfig:
    """What `prepare_corpus` builds. heldout_every: one file in N (by path hash) is held out."""

    out: str = "data/kimi-nano"
    vocab_size: int = 8192
    heldout_every: int = 40
    num_prompts: int = 32
    prompt_lines: int = 12
    seed: int = 0
    stdlib: str | None = None  # default: this interpreter's standard library

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) or self.vocab_size > 65536:
            raise ValueError(f"vocab_size: expected 258..65536 (uint16 ids), got {self.vocab_size}")
        if self.heldout_every < 2:
            raise ValueError(f"heldout_every: expected >= 2, got {self.heldout_every}")
        if self.num_prompts < 1 or self.prompt_lines < 1:
            raise ValueError("num_prompts, prompt_lines: expected >= 1")


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files under root, sorted by relative path (installed packages and
    caches excluded)."""
    if not root.is_dir():
        raise ValueError(f"stdlib: {root} is not a folder")
    files = [p for p in root.rglob("*.py") if not any(s in p.relative_to(root).as_posix() for s in SKIP_DIRS)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel_path: str, every: int) -> bool:
    """A stable split by file: the first 8 bytes of sha256(path) modulo `every` == 0."""
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little") % every == 0


def read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None when it is not (a few test files are deliberately not)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


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


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """All texts as one uint16 array, each followed by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(np.asarray(enc.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


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
    root = Path(cfg.stdlib) if cfg.stdlib else Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        text = read_text(path)
        if text and text.strip():
            (heldout if is_heldout(rel, cfg.heldout_every) else train).append((rel, text))
    if not train or not heldout:
        raise ValueError(f"stdlib: {root} has too few .py files for a train/held-out split")
    tok = train_tokenizer([t for _, t in train], cfg.vocab_size)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    counts = {}
    for name, docs in (("train", train), ("heldout", heldout)):
        ids = encode_documents(tok, [t for _, t in docs])
        ids.tofile(out / f"{name}.bin")
        counts[name] = int(ids.size)
    prompts = completion_prompts(heldout, cfg)
    (out / "heldout_prompts.json").write_text(json.dumps({"prompts": prompts}, indent=1) + "\n")
    manifest = {
        "config": asdict(cfg),
        "python": platform.python_version(),
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": tok.token_to_id(EOS),
        "mask_token_id": tok.token_to_id(MASK),
        "tokens": counts,
        "files": {"train": [r for r, _ in train], "heldout": [r for r, _ in heldout]},
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
    }
    add_config_arguments(parser, CorpusConfig, help_texts)


def main(args) -> int:
    from kdtree_engine.train.options import config_from_args

    out = prepare_corpus(config_from_args(CorpusConfig, args))
    m = read_manifest(out)
    tokens = m["tokens"]
    print(f"{out}: {tokens['train']} train / {tokens['heldout']} held-out tokens, vocab {m['vocab_size']}")
    return 0
