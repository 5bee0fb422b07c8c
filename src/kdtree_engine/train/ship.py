"""`kdtree-engine train ship TARGET DRAFTER`: a trained kimi-nano pair into the package's assets.

`train target` writes its folder as the package ships it (bf16 weights in shards of at most 15 MB, the
tokenizer, the held-out prompts); `train drafter` writes the drafter in float32, the precision it
trains and resumes in. Shipping copies the target's files and writes the drafter's weights in bf16
(half the bytes; the engine loads both in the precision it runs, so a bf16 run reads the same numbers).
Training logs, plots and optimizer states stay behind. The destination's old weight files are removed
first, so a target with fewer shards leaves none of the old ones. A folder missing a file the package
needs, or a drafter made for another vocabulary, is a ValueError naming it and nothing is written.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.model.config import read_json
from kdtree_engine.model.loader import INDEX, SINGLE, index_shards

TARGET_FILES = ("config.json", "generation_config.json", "heldout_prompts.json", "tokenizer.json",
                "tokenizer_config.json")  # fmt: skip


def _target_weights(target: Path) -> list[Path]:
    """The target's weight files: the shards its index names and the index, or one model.safetensors."""
    index = target / INDEX
    if index.is_file():
        return [target / name for name in index_shards(index)] + [index]
    return [target / SINGLE]


def _check(files: list[Path]) -> None:
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{missing[0]} is missing")


def _vocab(folder: Path) -> int:
    return read_json(folder / "config.json")["vocab_size"]


def _clear_weights(folder: Path) -> None:
    for old in folder.glob("model*.safetensors*"):
        old.unlink()


def ship(target: str | Path, drafter: str | Path, target_out: Path = KIMI_NANO,
         drafter_out: Path = KIMI_NANO_DFLASH) -> list[Path]:  # fmt: skip
    """Copies the pair into target_out and drafter_out (the drafter's weights as bf16); returns the
    files written."""
    target, drafter = Path(target), Path(drafter)
    sources = [target / name for name in TARGET_FILES] + _target_weights(target)
    _check(sources + [drafter / "config.json", drafter / SINGLE])
    if _vocab(target) != _vocab(drafter):
        raise ValueError(f"drafter {drafter} has vocab_size {_vocab(drafter)}, the target {_vocab(target)}")
    for folder in (target_out, drafter_out):
        folder.mkdir(parents=True, exist_ok=True)
        _clear_weights(folder)
    written = [Path(shutil.copyfile(f, target_out / f.name)) for f in sources]
    written.append(Path(shutil.copyfile(drafter / "config.json", drafter_out / "config.json")))
    state = load_file(str(drafter / SINGLE))
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(bf16, str(drafter_out / SINGLE), metadata={"format": "pt"})
    return written + [drafter_out / SINGLE]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="folder written by `train target` (e.g. out/kimi-nano)")
    parser.add_argument("drafter", help="folder written by `train drafter` (e.g. out/kimi-nano-dflash)")
    parser.add_argument("--target-out", default=str(KIMI_NANO), help="where the target goes")
    parser.add_argument("--drafter-out", default=str(KIMI_NANO_DFLASH), help="where the drafter goes")


def main(args: argparse.Namespace) -> int:
    written = ship(args.target, args.drafter, Path(args.target_out), Path(args.drafter_out))
    total = sum(f.stat().st_size for f in written if f.suffix == ".safetensors")
    print(f"shipped {len(written)} files; weights {total / 1e6:.1f} MB in all")
    return 0
