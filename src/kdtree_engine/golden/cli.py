"""`kdtree-engine golden --regen | --check`: write or replay the golden bundles under tests/golden/."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from kdtree_engine.golden.bundle import read_bundle, write_bundle

DEFAULT_DIR = Path(__file__).resolve().parents[3] / "tests" / "golden"
# op name (stored in each bundle's metadata) -> module with CASES and make_case(name)
SUITES = {
    "tree": "kdtree_engine.golden.tree_cases",
    "attention": "kdtree_engine.golden.attention_cases",
    "engine": "kdtree_engine.golden.engine_cases",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--regen", action="store_true", help="rewrite every bundle from the reference")
    mode.add_argument("--check", action="store_true", help="recompute and compare with the stored bundles")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="bundle folder")
    parser.add_argument("--op", choices=sorted(SUITES), action="append", help="only these suites")


def all_cases(ops: list[str] | None = None):
    """Yields (op, case name, make_case) for every golden case."""
    for op in ops or SUITES:
        module = importlib.import_module(SUITES[op])
        for name in module.CASES:
            yield op, name, module.make_case


# Floating-point results of the float32 reference may differ in the last few bits between CPUs (MKL
# picks its kernels per instruction set); a stale bundle differs by far more.
FLOAT_RTOL, FLOAT_ATOL = 1e-5, 1e-6


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype; integers and booleans equal; floats equal to FLOAT_RTOL / FLOAT_ATOL, NaN
    where the other has NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=FLOAT_RTOL, atol=FLOAT_ATOL, equal_nan=True)
    return torch.equal(a, b)


def check(
    directory: Path, ops: list[str] | None = None, report: Callable[[str, str], None] | None = None
) -> list[str]:
    """Names of the bundles whose stored tensors differ from a fresh computation, or that are missing or
    unreadable. `report(name, verdict)` is called after each bundle: "ok", "differs", "missing" or
    "unreadable (why)"."""
    stale = []
    for _, name, make_case in all_cases(ops):
        path = directory / f"{name}.safetensors"
        try:
            stored = read_bundle(path).tensors
        except (ValueError, OSError, SafetensorError) as exc:
            verdict = "missing" if not path.exists() else f"unreadable ({exc})"
        else:
            fresh, _, _ = make_case(name)
            same = stored.keys() == fresh.keys() and all(_same(stored[k], fresh[k]) for k in fresh)
            verdict = "ok" if same else "differs"
        if verdict != "ok":
            stale.append(name)
        if report is not None:
            report(name, verdict)
    return stale


def main(args: argparse.Namespace) -> int:
    """Exit 0: done / every bundle matches; 1: a bundle differs or is missing; 2: a bad argument."""
    if not args.dir.is_dir():
        print(
            f"kdtree-engine golden: --dir {args.dir} is not a folder (run from a checkout, or pass --dir)",
            file=sys.stderr,
        )
        return 2
    cases = list(all_cases(args.op))
    if args.regen:
        for i, (op, name, make_case) in enumerate(cases, 1):
            tensors, seed, params = make_case(name)
            write_bundle(args.dir / f"{name}.safetensors", tensors, op=op, seed=seed, params=params)
            print(f"[{i}/{len(cases)}] wrote {args.dir / name}.safetensors", flush=True)
        return 0
    if not any(args.dir.glob("*.safetensors")):
        print(
            f"kdtree-engine golden: --dir {args.dir} holds no bundles (*.safetensors); "
            "write them with --regen",
            file=sys.stderr,
        )
        return 2
    done = [0]
    start = time.perf_counter()

    def report(name: str, verdict: str) -> None:  # progress: one line per bundle as it is checked
        done[0] += 1
        elapsed = time.perf_counter() - start
        print(f"[{done[0]}/{len(cases)}] {name}: {verdict} ({elapsed:.1f} s)", flush=True)

    stale = check(args.dir, args.op, report)
    print(f"{len(cases) - len(stale)}/{len(cases)} bundles match the reference")
    if stale:
        print(
            f"kdtree-engine golden: {len(stale)} bundle(s) differ from the reference or are missing: "
            f"{', '.join(stale)} (after an intended change: kdtree-engine golden --regen)",
            file=sys.stderr,
        )
    return 1 if stale else 0
