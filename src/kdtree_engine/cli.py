"""The `kdtree-engine` command. Each subcommand lives in its own module, imported only when used;
a module provides `add_arguments(parser)` and `main(args) -> int`.

A failure the user can fix (a bad argument, a missing or broken file, a missing optional dependency, an
allocation that does not fit) is one line on stderr, `kdtree-engine <command>: <message>`, and exit code
2. For every subcommand, from the first import on: Ctrl-C is one line (`interrupted`) and exit 130; a
stdout pipe closed by its reader (`| head`) exits 141 quietly; a closed stdout (`>&-`) discards the
output. Anything else is a bug and keeps its traceback (as does every error when the environment
variable KDTREE_ENGINE_TRACEBACK is set).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys

COMMANDS = {
    "tree": ("kdtree_engine.tree.demo", "build, compile and accept a draft tree and print it"),
    "golden": ("kdtree_engine.golden.cli", "regenerate or check the golden reference bundles"),
    "generate": ("kdtree_engine.engine.cli", "generate text with autoregressive, DFlash or DDTree decoding"),
}
BENCHMARKS = {
    "tree": ("kdtree_engine.bench.tree", "tree build/compile/accept kernels against CPU builders (CUDA)"),
    "attention": ("kdtree_engine.bench.attention", "tree-verify MLA attention against naive torch"),
    "e2e": ("kdtree_engine.bench.e2e", "whole generation runs: autoregressive, DFlash and DDTree"),
    "sglang": ("kdtree_engine.bench.sglang", "the SGLang DDTree port's tree path against our drop-in"),
    "kimi": ("kdtree_engine.bench.kimi", "one GPU's share of Kimi-K2 measured, the 8-GPU round projected"),
    "sharded-topk": ("kdtree_engine.bench.sharded_topk", "TP draft top-k + tree on R ranks vs the port's"),
}
TRAINING = {
    "data": ("kdtree_engine.train.data", "prepare the kimi-nano corpus and tokenizer (Python stdlib source)"),
    "target": ("kdtree_engine.train.target", "train the kimi-nano target (transformers, resumable)"),
    "drafter": ("kdtree_engine.train.drafter", "train a DFlash drafter for a target (resumable)"),
    "carry": ("kdtree_engine.train.carry", "pack a prepared corpus for the GPU machine, or unpack it there"),
    "ship": ("kdtree_engine.train.ship", "copy a trained target and drafter into the package's assets"),
}
# Optional dependencies -> the pyproject extra that installs them.
EXTRAS = {"transformers": "hf", "tokenizers": "hf", "triton": "gpu", "matplotlib": "bench", "tqdm": "train"}
# What to make smaller when an allocation does not fit, per command.
SMALLER = {
    "generate": "--max-new-tokens, --budget or the batch (fewer --prompt)",
    "tree": "--budget, --depth or --vocab",
}
DESCRIPTION = (
    "DDTree speculative decoding for DeepSeek-V3 / Kimi-K2 class models: generate text (the demo needs "
    "no download), tree ops, golden bundles, benchmarks and training of the shipped kimi-nano."
)
_NO_MEMORY = re.compile(r"out of memory|not enough memory|can't allocate memory|cannot allocate memory", re.I)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`--help` shows the usage); subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def version() -> str:
    """The installed distribution's version, else the package's __version__ (a source checkout)."""
    from importlib import metadata

    try:
        return metadata.version("kdtree-engine")
    except metadata.PackageNotFoundError:
        from kdtree_engine import __version__

        return __version__


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to the help of every option that has a default value and whose help does
    not already speak of its default (flags and None defaults are left alone), in the command's own
    subcommands too (`train carry pack`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
            continue
        if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
            continue
        if action.default is None or action.default == argparse.SUPPRESS:
            continue
        text = action.help or ""
        if "default" not in text.lower():
            action.help = f"{text} (default: %(default)s)".lstrip()


def _add(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(parser)
    except ModuleNotFoundError as exc:
        if not module.startswith(exc.name or "\0"):
            raise
        parser.set_defaults(_missing=True)
    _show_defaults(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kdtree-engine", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bench, name, module, help_text)
    train = sub.add_parser("train", help="train kimi-nano and its drafter").add_subparsers(
        dest="stage", required=True
    )
    for name, (module, help_text) in TRAINING.items():
        _add(train, name, module, help_text)
    return parser


def _memory_detail(exc: BaseException) -> str:
    """The first sentences of an allocator's message, without the C++ enforce prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", text)
    return ". ".join(text.split(". ")[:2]).rstrip(".")[:240]


def user_error(exc: BaseException, command: str) -> str | None:
    """The one-line message for an error the user can act on, or None for a bug (re-raised)."""
    if isinstance(exc, ModuleNotFoundError):
        root = (exc.name or "").split(".")[0]
        if root in EXTRAS:
            extra = EXTRAS[root]
            return (
                f"{root} is not installed; it comes with the [{extra}] extra: "
                f'pip install -e ".[{extra}]" in a checkout, or pip install "kdtree-engine[{extra}]"'
            )
        return str(exc)
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError)
        and (type(exc).__name__ == "OutOfMemoryError" or _NO_MEMORY.search(str(exc)))
    ):
        smaller = SMALLER.get(command, "problem size")
        return f"not enough memory ({_memory_detail(exc)}); try a smaller {smaller}"
    if isinstance(exc, (ValueError, OSError)):  # FileNotFoundError, PermissionError, JSON errors, ...
        return str(exc) or type(exc).__name__
    return None


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        pass


def _open_stdout() -> None:
    """A command started with stdout closed (`>&-`) has sys.stdout None: its output is discarded, as
    Python's print() does, instead of failing on the first write."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def _command_name(args: argparse.Namespace | None, argv: list[str] | None) -> str:
    """ "generate", "bench tree", ...: from the parsed arguments, or before parsing from argv."""
    if args is not None:
        parts = (args.command, getattr(args, "benchmark", None), getattr(args, "stage", None))
        return " ".join(filter(None, parts))
    words = sys.argv[1:] if argv is None else argv
    return next((w for w in words if w in COMMANDS or w in ("bench", "train")), "")


class _CtrlC:
    """Remembers a Ctrl-C as well as raising KeyboardInterrupt: an extension module's start-up can
    swallow the exception (importing torch clears a pending one at one point), and the command must
    still stop. Installed only where SIGINT has Python's default handler (not where it is ignored,
    as in a background job) and in the main thread."""

    def __init__(self) -> None:
        self.pressed, self.installed = False, False

    def __enter__(self) -> _CtrlC:
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._handle)
                self.installed = True
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _handle(self, signum, frame) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


def _run(argv: list[str] | None, parsed: list) -> int:
    """Parses argv (the subcommand modules are imported here) and runs the subcommand; parsed[0] is
    the parsed arguments once known, for the messages."""
    with _CtrlC() as ctrl_c:
        parser = build_parser()
        ctrl_c.check()  # pressed while the subcommands' modules were imported
    args = parser.parse_args(argv)
    parsed.append(args)
    if getattr(args, "_missing", False):
        print(f"kdtree-engine: '{_command_name(args, argv)}' is not available in this build", file=sys.stderr)
        return 2
    code = int(importlib.import_module(args._module).main(args) or 0)
    sys.stdout.flush()  # a reader that went away shows here, not at the interpreter's exit
    return code


def main(argv: list[str] | None = None) -> int:
    _open_stdout()
    parsed: list = []
    try:
        return _run(argv, parsed)
    except KeyboardInterrupt:
        name = _command_name(parsed[0] if parsed else None, argv)
        print(f"kdtree-engine {name}: interrupted".replace(" :", ":"), file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a SIGPIPE would
        _silence_stdout()
        return 141
    except SystemExit as exc:  # argparse (usage errors, --help) or `raise SystemExit("message")`
        if not isinstance(exc.code, str) or not parsed:
            raise
        message = exc.code
    except Exception as exc:
        message = user_error(exc, _command_name(parsed[0] if parsed else None, argv))
        if message is None or os.environ.get("KDTREE_ENGINE_TRACEBACK"):
            raise
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"kdtree-engine {_command_name(parsed[0] if parsed else None, argv)}: {one_line}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
