"""`kdtree-engine golden --regen | --check`: write or replay the golden bundles under tests/golden/."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kdtree_engine.golden.bundle import read_bundle, write_bundle
from kdtree_engine.golden.tree_cases import CASES, make_case

DEFAULT_DIR = Path(__file__).resolve().parents[3] / "tests" / "golden"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--regen", action="store_true", help="rewrite every bundle from the reference")
    mode.add_argument("--check", action="store_true", help="recompute and compare with the stored bundles")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="bundle folder (default tests/golden)")


def check(directory: Path) -> list[str]:
    """Names of the bundles whose stored tensors differ from a fresh computation."""
    stale = []
    for name in CASES:
        stored = read_bundle(directory / f"{name}.safetensors").tensors
        fresh, _, _ = make_case(name)
        if stored.keys() != fresh.keys() or any(not torch.equal(stored[k], fresh[k]) for k in fresh):
            stale.append(name)
    return stale


def main(args: argparse.Namespace) -> int:
    if args.regen:
        for name in CASES:
            tensors, seed, params = make_case(name)
            write_bundle(args.dir / f"{name}.safetensors", tensors, op="tree", seed=seed, params=params)
            print(f"wrote {args.dir / name}.safetensors")
        return 0
    stale = check(args.dir)
    for name in stale:
        print(f"differs: {name}")
    print(f"{len(CASES) - len(stale)}/{len(CASES)} bundles match the reference")
    return 1 if stale else 0
