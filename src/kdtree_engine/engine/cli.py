"""`kdtree-engine generate`: stream text from autoregressive, DFlash or DDTree decoding and print stats.

The command only: the decoding options are GenerationConfig's fields (train.options derives the flags,
HELP below gives their help), checkpoints are read by engine.checkpoint and tokenized by
engine.tokenizer, sizes come from engine.memory. With --model/--drafter it runs HF-format checkpoints;
with --demo (or neither path) the embedded kimi-nano target and its trained DFlash drafter on a
held-out code-completion prompt (no download, CPU is enough); `--demo random` a seeded tiny random
target with a labelled stand-in drafter (for tests of the engine). Every argument, path and size is
checked before anything large is loaded or anything is printed on stdout; errors are one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace

import torch

from kdtree_engine.engine.checkpoint import (
    Checkpoints,
    checkpoint_dir,
    eos_tokens,
    load_checkpoints,
    read_checkpoints,
)
from kdtree_engine.engine.checks import check_drafter, check_prompts, check_stop_tokens
from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.loop import GenerationOutput, generate
from kdtree_engine.engine.memory import check_memory_before_loading, clamp_note, request_limits
from kdtree_engine.engine.stats import round_cost
from kdtree_engine.engine.text import TextStream
from kdtree_engine.engine.tokenizer import Tokenizer, load_tokenizer
from kdtree_engine.impl import IMPLS, kernels_unavailable, resolve_impl
from kdtree_engine.train.options import add_config_arguments, config_from_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEMOS = ("kimi-nano", "random")
KIMI_NANO_EOS = "0, <|endoftext|>"  # assets/kimi-nano/generation_config.json

# Help of the options derived from GenerationConfig (and its SamplingParams): names, types and
# defaults come from the fields.
HELP = {
    "max_new_tokens": "new tokens per request at most (clamped to the target's context); a checkpoint's "
    "generation_config.json may set it",
    "method": f"one of {', '.join(METHODS)}",
    "budget": "DDTree node budget (root not counted), or auto: each round picks the budget (0: an "
    "autoregressive step) with the most expected tokens per second, from measured round costs",
    "temperature": "0: greedy; a checkpoint's generation_config.json may set it (with do_sample)",
    "top_p": "1.0: off; a checkpoint's generation_config.json may set it (with do_sample)",
    "top_k": "0: off; a checkpoint's generation_config.json may set it (with do_sample)",
    "seed": "key of the sampling noise: a sampled run is reproducible from it",
    "stop_tokens": "stop token id (repeatable); default: the checkpoint's eos_token_id (the kimi-nano "
    f"demo: {KIMI_NANO_EOS}; --demo random: none)",
    "stop_strings": "stop a request once its text contains S (repeatable; see below)",
    "impl": f"one of {', '.join(IMPLS)}. ref: the torch reference; triton: the Triton kernels; hopper: the "
    "Hopper attention kernel where it applies, Triton elsewhere (default: the fastest that applies)",
    "cuda_graphs": "run every decoding round eagerly (default on CUDA with the kernels: rounds are "
    "replayed from CUDA graphs captured after the first one; the tokens are the same)",
    "row_invariant": "compute every token's row with an order that does not depend on the rest of the "
    "forward (with the kernels): greedy DDTree and DFlash then give the autoregressive tokens bit for bit "
    "in any dtype, and a request the tokens it gets alone",
}
FLAGS = {"stop_tokens": "--stop", "stop_strings": "--stop-string"}
METAVARS = {"stop_tokens": "ID", "stop_strings": "S"}
FROM_GENERATION_CONFIG = ("max_new_tokens", "temperature", "top_p", "top_k")

EPILOG = """\
output:
  Streaming (the default) prints each request's text as its tokens are committed. Batch 1: the text
  as it comes, then a newline. Batch > 1: each piece of request b's text on its own line, prefixed
  "[b] ", in the order the pieces come (a newline inside the text starts a new "[b] " line).
  --no-stream prints one "[b] text" line per request at the end. Then the stats line of each method;
  with --compare, per method what a round costs in decode steps against the tokens it commits.
  Text is decoded incrementally (a character split across tokens is printed once complete), special
  tokens skipped unless --show-special-tokens. Without a tokenizer the text is the token ids.

checkpoints:
  The model dir's generation_config.json, when present, gives the defaults of --temperature, --top-p,
  --top-k (taken when its do_sample is true, as in transformers), --max-new-tokens and the stop tokens
  (eos_token_id; else config.json's); flags win. A line on stderr says what was taken. Paths, prompts
  and memory are checked before the weights are loaded.

stop strings:
  --stop-string S stops a request at the token whose text completes S: the engine decodes each
  round's tokens as they arrive and the request commits nothing after that token (the stats count
  tokens up to and including it). The printed text ends before S (S itself is not printed). While
  streaming, an end of the text that could begin S is printed once the next tokens show that it
  does not.
"""


class _PromptAction(argparse.Action):
    """--prompt / --prompt-ids: appends (kind, value) to args.prompts, keeping their order on the line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append((self.const, values))
        setattr(namespace, self.dest, items)


def _add_sources(parser: argparse.ArgumentParser) -> None:
    """Where the models and prompts come from."""
    parser.add_argument("--model", help="target checkpoint dir (HF DeepSeek-V3 / Kimi-K2 format)")
    parser.add_argument("--drafter", help="DFlash drafter checkpoint dir (config.json + safetensors)")
    parser.add_argument(
        "--demo",
        nargs="?",
        const="kimi-nano",
        choices=DEMOS,
        default=None,
        help="no download: kimi-nano, the embedded trained target with its trained drafter (the "
        "default without --model), or random: a tiny random target with a stand-in drafter",
    )
    parser.add_argument(
        "--demo-drafter",
        choices=("oracle", "random"),
        default=None,
        help="drafter of --demo random: a noisy oracle stand-in (default) or a random DFlash drafter",
    )
    parser.add_argument(
        "--prompt", dest="prompts", action=_PromptAction, const="text", metavar="TEXT",
        help="prompt text (token ids separated by spaces without a tokenizer); repeat for a batch",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-ids", dest="prompts", action=_PromptAction, const="ids", metavar="IDS",
        help='a prompt as token ids, e.g. "1 2 3", with or without a tokenizer (never templated by '
        "--chat); repeatable, mixes with --prompt in command-line order",
    )  # fmt: skip
    parser.add_argument(
        "--chat",
        action="store_true",
        help="apply the tokenizer's chat template to each --prompt (one user message, with the "
        "generation prompt)",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """How to run and what to print (not part of GenerationConfig)."""
    parser.add_argument("--ignore-eos", action="store_true", help="no default stop token")
    parser.add_argument(
        "--show-special-tokens", action="store_true", help="keep special tokens in the printed text"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run the tokenizer code shipped in the model dir (e.g. Kimi-K2's)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run DFlash (after DDTree) and autoregressive decoding; report speedups, what a "
        "round costs, and whether the outputs match",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="default: bfloat16 on CUDA for checkpoints, float32 otherwise",
    )
    parser.add_argument("--no-stream", action="store_true", help="print the output only at the end")
    parser.add_argument("--no-stage-timing", action="store_true", help="skip the per-stage timers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    _add_sources(parser)
    add_config_arguments(
        parser, GenerationConfig, HELP, flags=FLAGS, deferred=FROM_GENERATION_CONFIG, metavars=METAVARS
    )
    _add_run_options(parser)


# --- arguments -----------------------------------------------------------------------------------


def _config(args, defaults: dict | None = None) -> GenerationConfig:
    """The GenerationConfig of the arguments; an option left out takes defaults[field] (a checkpoint's
    generation_config.json and eos token), else the field's default."""
    return config_from_args(GenerationConfig, args, defaults)


def _methods(args) -> list[str]:
    """--compare runs the chosen method, then DFlash (when the method is DDTree) and autoregressive."""
    methods = [args.method]
    if args.compare and args.method == "ddtree":
        methods.append("dflash")
    if args.compare and args.method != "autoregressive":
        methods.append("autoregressive")
    return methods


def _check_device(name: str) -> None:
    """--device: cpu, cuda or cuda:N with a GPU there."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: {name!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: kdtree-engine runs on cpu or cuda (cuda:N), not {device.type}")
    if device.type == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is available to torch here; use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")


def _check_impl_device(impl: str | None, device: str, row_invariant: bool = False) -> None:
    """Triton kernels need a CUDA device (or the interpreter, TRITON_INTERPRET=1, as the tests use);
    --row-invariant needs the kernels (checked here, before anything loads)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kernels_unavailable(impl, kind):
        raise ValueError(f"--impl {impl}: needs --device cuda (a CUDA GPU); use --impl ref on the CPU")
    if row_invariant and resolve_impl(impl, torch.device(kind)) != "triton":
        raise ValueError(
            "--row-invariant: needs the kernels (--device cuda, or --impl triton with the Triton "
            "interpreter); the reference ops are not row-invariant"
        )


def _parse_ids(flag: str, text: str) -> list[int]:
    try:
        return [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
    except ValueError:
        raise ValueError(f"{flag}: expected token ids separated by spaces, got {text!r}") from None


def _prompts(args, tok: Tokenizer, chat_missing: str | None = None) -> list[list[int]]:
    """The prompts as token ids, in command-line order (--chat applies the chat template to texts)."""
    if args.chat:
        tok.check_chat(chat_missing)
    out = []
    for kind, value in args.prompts or []:
        if kind == "ids":
            out.append(_parse_ids("--prompt-ids", value))
        else:
            out.append(tok.chat(value) if args.chat else tok.encode(value))
    return out


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _note_clamped(config: GenerationConfig, prompts: list[list[int]], context: int | None) -> None:
    """One line on stderr when max_new_tokens does not fit the target's context after a prompt."""
    note = clamp_note(config.max_new_tokens, [len(p) for p in prompts], context)
    if note:
        _progress(note)


# --- sessions --------------------------------------------------------------------------------------


@dataclass
class _Session:
    """The loaded models, the tokenizer, the checked prompts, the configuration and the text options;
    intro: what to print on stdout before the first run (the demo's prompt)."""

    target: object
    drafter: object | None
    tokenizer: Tokenizer
    prompts: list[list[int]]
    config: GenerationConfig
    skip_special_tokens: bool = True
    intro: str = ""


def _random_demo(args, config: GenerationConfig, methods: list[str]) -> _Session:
    """`--demo random`: the seeded tiny random target and a stand-in (or random) drafter, token ids."""
    from kdtree_engine.engine import demo as d

    tok = Tokenizer(None, "the demo")
    prompts = _prompts(args, tok, "the demo has no tokenizer") or [list(d.DEMO_PROMPT)]
    dtype = DTYPES[args.dtype or "float32"]
    if args.device == "cpu":
        torch.set_num_threads(1)  # a tiny model: more threads only add synchronization
    target = d.demo_target(args.device, dtype)
    cfg = target.config
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)  # before the oracle
    check_stop_tokens(config.stop_tokens, cfg.vocab_size)
    _note_clamped(config, prompts, cfg.max_position_embeddings)
    drafter = None
    if methods != ["autoregressive"]:
        horizon = max(
            request_limits([len(p) for p in prompts], config.max_new_tokens, cfg.max_position_embeddings)
        )
        drafter = d.demo_drafter(args.demo_drafter or "oracle", target, prompts, horizon)
    return _Session(target, drafter, tok, prompts, config, not args.show_special_tokens)


def _kimi_nano_args(args) -> tuple[argparse.Namespace, str]:
    """(the arguments of the default demo, the intro to print): the embedded kimi-nano folders as --model
    and --drafter and, without a prompt, the first held-out code-completion prompt (engine.demo)."""
    from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
    from kdtree_engine.engine.demo import as_training_text, kimi_nano_prompt

    if args.model is not None or args.drafter is not None:
        raise ValueError("--demo: the demo brings its own model and drafter; drop --model/--drafter")
    args = argparse.Namespace(**vars(args))
    args.model, args.drafter = str(KIMI_NANO), str(KIMI_NANO_DFLASH)
    if not args.prompts:
        text, intro = kimi_nano_prompt()
        args.prompts = [("text", text)]
        return args, intro
    texts = [(kind, as_training_text(value) if kind == "text" else value) for kind, value in args.prompts]
    if texts != args.prompts:
        _progress(
            "--prompt: the newline at its end is dropped: kimi-nano's tokenizer merges a newline with the "
            "next line's indentation, so the model writes both itself"
        )
    args.prompts = texts
    return args, ""


def _checkpoint_config(args, checkpoints: Checkpoints) -> tuple[GenerationConfig, str]:
    """(the GenerationConfig of the arguments over the checkpoint's defaults, the line that says what
    generation_config.json gave). Stop tokens: --stop, else none with --ignore-eos, else the
    checkpoint's eos."""
    defaults = dict(checkpoints.defaults)
    taken = [
        f"stop tokens {list(v)}" if k == "stop_tokens" else f"{k} {v}"
        for k, v in defaults.items()
        if getattr(args, k) is None and not (k == "stop_tokens" and args.ignore_eos)
    ]
    note = f"generation_config.json: {', '.join(taken)} (flags override)" if taken else ""
    defaults.setdefault("stop_tokens", eos_tokens(checkpoints.target_config))
    if args.ignore_eos:
        defaults["stop_tokens"] = ()
    return _config(args, defaults), note


def _check_sources(args, methods: list[str]) -> None:
    """The paths first (naming --model / --drafter), then that the methods have what they need."""
    if args.model is None:
        raise ValueError("--model: a target checkpoint is required unless --demo is given")
    checkpoint_dir(args.model, "--model")
    if args.drafter:
        checkpoint_dir(args.drafter, "--drafter", drafter=True)
    if methods != ["autoregressive"] and not args.drafter:
        raise ValueError(
            f"--drafter: method {args.method!r} needs a DFlash drafter checkpoint "
            "(pass --drafter DIR, or --method autoregressive)"
        )
    if not args.prompts:
        raise ValueError("--prompt: give at least one prompt (--prompt TEXT or --prompt-ids IDS)")


def _checkpoint_session(args, config: GenerationConfig, methods: list[str], intro: str) -> _Session:
    """--model / --drafter (or the kimi-nano demo's folders): paths, configs, tokenizer, prompts and
    memory are checked first; then the weights are loaded."""
    _check_sources(args, methods)
    checkpoints = read_checkpoints(
        args.model, args.drafter, model_argument="--model", drafter_argument="--drafter"
    )
    config, note = _checkpoint_config(args, checkpoints)
    tok = load_tokenizer(args.model, args.trust_remote_code)
    cfg = checkpoints.target_config
    prompts = check_prompts(_prompts(args, tok), cfg.vocab_size, cfg.max_position_embeddings)
    check_stop_tokens(config.stop_tokens, cfg.vocab_size)
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    check_memory_before_loading(checkpoints, config, [len(p) for p in prompts], methods, dtype, args.device)
    if note:
        _progress(note)
    _note_clamped(config, prompts, cfg.max_position_embeddings)
    if methods == ["autoregressive"]:
        checkpoints = replace(checkpoints, drafter_dir=None, drafter_config=None)
    target, drafter = load_checkpoints(checkpoints, dtype, args.device, _progress)
    for method in methods:
        check_drafter(target, drafter, method)
    return _Session(target, drafter, tok, prompts, config, not args.show_special_tokens, intro)


def _load(args) -> _Session:
    """Checks every argument that needs no file first, then the demo's or the checkpoints' session."""
    _check_device(args.device)
    _check_impl_device(args.impl, args.device, args.row_invariant)
    config = _config(args)  # bad flags fail here, before any file is read
    methods = _methods(args)
    demo = args.demo or ("kimi-nano" if args.model is None and args.drafter is None else None)
    if args.demo_drafter and demo != "random":
        raise ValueError("--demo-drafter: only with --demo random (kimi-nano has its trained drafter)")
    if demo == "random":
        return _random_demo(args, config, methods)
    intro = ""
    if demo == "kimi-nano":
        args, intro = _kimi_nano_args(args)
    return _checkpoint_session(args, config, methods, intro)


# --- runs ------------------------------------------------------------------------------------------


class _Printer:
    """Prints the requests' texts (see EPILOG): streamed through on_tokens, or all at the end."""

    def __init__(self, session: _Session, stream: bool) -> None:
        self.stream, self.batch = stream, len(session.prompts)
        stops, skip = session.config.stop_strings, session.skip_special_tokens
        self.texts = [TextStream(session.tokenizer, stops, skip) for _ in range(self.batch)]

    def on_tokens(self, b: int, tokens: list[int]) -> None:
        self._write(b, self.texts[b].push(tokens))

    def _write(self, b: int, piece: str) -> None:
        if not piece:
            return
        if self.batch == 1:
            sys.stdout.write(piece)
        else:
            lines = piece.split("\n")
            if len(lines) > 1 and not lines[-1]:
                lines.pop()  # the next piece starts a new line anyway
            sys.stdout.write("".join(f"[{b}] {line}\n" for line in lines))
        sys.stdout.flush()

    def finish(self, out: GenerationOutput) -> None:
        if self.stream:
            for b, text in enumerate(self.texts):
                self._write(b, text.flush())
            if self.batch == 1:
                print()
            return
        for b, (text, tokens) in enumerate(zip(self.texts, out.tokens)):
            text.push(tokens)
            text.flush()
            print(f"[{b}] {text.text}")


def _generate(session: _Session, method: str, **kwargs) -> GenerationOutput:
    config = replace(session.config, method=method)
    return generate(
        session.target, session.drafter, session.prompts, config, tokenizer=session.tokenizer, **kwargs
    )


def _run(session: _Session, method: str, stream: bool, stage_timing: bool) -> GenerationOutput:
    printer = _Printer(session, stream)
    budget = f" (budget {session.config.budget})" if method == "ddtree" else ""
    print(f"--- {method}{budget} ---")
    out = _generate(
        session, method, on_tokens=printer.on_tokens if stream else None, stage_timing=stage_timing
    )
    printer.finish(out)
    print(out.stats.summary())
    return out


def _warm_up(session: _Session, methods: list[str]) -> None:
    """On a GPU, one untimed run per method first, so that no timed run pays for compiling kernels."""
    if session.target.device.type != "cuda":
        return
    print("(GPU: one untimed warm-up run per method compiles the kernels first)")
    for method in methods:
        _generate(session, method)


def _explain(session: _Session, method: str, base: GenerationOutput, out: GenerationOutput) -> bool:
    """Prints where each differing request parted from autoregressive decoding and whether the target's
    logits there nearly tie (engine.compare); True when every difference is such a tie."""
    from kdtree_engine.engine.compare import explain

    found = explain(session.target, session.prompts, base.tokens, out.tokens, impl=session.config.impl)
    for d in found:
        print(f"{method:>8}: {d.describe()}")
    return all(d.tie for d in found)


SLOWER = (
    "(a method is faster only where a round costs fewer decode steps than the tokens it commits: on the "
    "CPU a forward's cost grows with its tokens and the tree is built in Python; on a GPU a verify "
    "forward of budget + 1 tokens costs little more than a decode step)"
)


def _summary(method: str, out: GenerationOutput, base: GenerationOutput, greedy: bool) -> str:
    """The compare line of one method against autoregressive decoding (base)."""
    same = out.tokens == base.tokens
    speed = base.stats.wall_time / out.stats.wall_time if out.stats.wall_time else float("nan")
    fewer = base.stats.target_forwards / max(out.stats.target_forwards, 1)
    verdict = ("identical: YES" if same else "identical: NO") if greedy else "sampled"
    return (
        f"{method:>8}: target forwards {out.stats.target_forwards} vs {base.stats.target_forwards} "
        f"({fewer:.2f}x fewer), mean accepted length {out.stats.mean_accept_len:.2f}, "
        f"wall time speedup {speed:.2f}x, output {verdict}"
    )


def _compare(runs: dict[str, GenerationOutput], greedy: bool, session: _Session | None = None) -> int:
    """Prints each method against autoregressive decoding (forwards, tau, speedup, identical output)
    and what its round costs in decode steps against what it commits (and, when a method is slower,
    what that depends on). Exit code 1 when a greedy output differs in a way that a near-tie of the
    target's logits (rounding of a verify forward against a decode step) does not explain."""
    base = runs["autoregressive"]
    print("--- compare with autoregressive ---")
    same_all, slower = True, False
    for method, out in runs.items():
        if method == "autoregressive":
            continue
        print(_summary(method, out, base, greedy))
        print(f"{'':>8}  {round_cost(out.stats, base.stats)}")
        slower |= out.stats.wall_time > base.stats.wall_time
        if greedy and out.tokens != base.tokens:
            same_all &= session is not None and _explain(session, method, base, out)
    if slower:
        print(SLOWER)
    if not greedy:
        print("(sampled outputs are not expected to be identical; their distribution is the target's)")
        return 0
    return 0 if same_all else 1


def main(args: argparse.Namespace) -> int:
    session = _load(args)
    methods = _methods(args)
    if session.intro:
        print(session.intro)
    if len(methods) > 1:
        _warm_up(session, methods)
    timing = not args.no_stage_timing
    runs = {m: _run(session, m, not args.no_stream, timing) for m in methods}
    if "autoregressive" in runs and len(runs) > 1:
        return _compare(runs, greedy=session.config.sampling.greedy, session=session)
    return 0
