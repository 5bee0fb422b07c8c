"""The `kdtree-engine` command. Each subcommand lives in its own module, imported only when used;
a module provides `add_arguments(parser)` and `main(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "tree": ("kdtree_engine.tree.demo", "build, compile and accept a draft tree and print it"),
    "golden": ("kdtree_engine.golden.cli", "regenerate or check the golden reference bundles"),
    "generate": ("kdtree_engine.engine.cli", "generate text with autoregressive, DFlash or DDTree decoding"),
}
BENCHMARKS = {
    "tree": ("kdtree_engine.bench.tree", "GPU tree build/compile/accept against CPU builders"),
    "attention": ("kdtree_engine.bench.attention", "tree-verify MLA attention against naive torch"),
    "e2e": ("kdtree_engine.bench.e2e", "whole generation runs: autoregressive, DFlash and DDTree"),
}


def _add(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(parser)
    except ModuleNotFoundError as exc:
        if not module.startswith(exc.name or "\0"):
            raise
        parser.set_defaults(_missing=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdtree-engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bench, name, module, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", False):
        name = " ".join(filter(None, (args.command, getattr(args, "benchmark", None))))
        print(f"kdtree-engine: '{name}' is not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
