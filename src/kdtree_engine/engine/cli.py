"""`kdtree-engine generate`: stream text from autoregressive, DFlash or DDTree decoding and print stats.

With --model/--drafter it loads HF-format checkpoints (tokenizer files in the model dir are used when
present, else prompts are space-separated token ids; its generation_config.json gives defaults). With
--demo (or neither path) it runs the embedded kimi-nano target and its trained DFlash drafter through the
same loaders, on a held-out code-completion prompt: no download, CPU is enough. `--demo random` runs a
seeded tiny random target with a labelled stand-in drafter instead (for tests of the engine). Argument
errors are one line on stderr and exit 2, before anything is printed or loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kdtree_engine.engine.checks import check_drafter, check_prompts, check_stop_tokens, is_int
from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.loop import GenerationOutput, generate
from kdtree_engine.engine.sampling import SamplingParams
from kdtree_engine.engine.text import TextStream
from kdtree_engine.impl import IMPLS, kernels_unavailable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HF_EXTRA = 'pip install "kdtree-engine[hf]" (pip install -e ".[hf]" in a checkout)'
DEMOS = ("kimi-nano", "random")

EPILOG = """\
output:
  Streaming (the default) prints each request's text as its tokens are committed. Batch 1: the text
  as it comes, then a newline. Batch > 1: each piece of request b's text on its own line, prefixed
  "[b] ", in the order the pieces come (a newline inside the text starts a new "[b] " line).
  --no-stream prints one "[b] text" line per request at the end. Then the stats line of each method.
  Text is decoded incrementally (a character split across tokens is printed once complete), special
  tokens skipped unless --show-special-tokens. Without a tokenizer the text is the token ids.

checkpoints:
  The model dir's generation_config.json, when present, gives the defaults of --temperature, --top-p,
  --top-k (taken when its do_sample is true, as in transformers), --max-new-tokens and the stop tokens
  (eos_token_id; else config.json's); flags win. A line on stderr says what was taken.

stop strings:
  --stop-string S cuts a request's printed text before the first S (S itself is not printed). The
  engine stops on token ids only, so the request keeps decoding up to its token limit or stop token
  (the stats count those tokens). While streaming, an end of the text that could begin S is printed
  once the next tokens show that it does not.
"""


class _PromptAction(argparse.Action):
    """--prompt / --prompt-ids: appends (kind, value) to args.prompts, keeping their order on the line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append((self.const, values))
        setattr(namespace, self.dest, items)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
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
        "--prompt",
        dest="prompts",
        action=_PromptAction,
        const="text",
        metavar="TEXT",
        help="prompt text (token ids separated by spaces without a tokenizer); repeat for a batch",
    )
    parser.add_argument(
        "--prompt-ids",
        dest="prompts",
        action=_PromptAction,
        const="ids",
        metavar="IDS",
        help='a prompt as token ids, e.g. "1 2 3", with or without a tokenizer (never templated by '
        "--chat); repeatable, mixes with --prompt in command-line order",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="apply the tokenizer's chat template to each --prompt (one user message, with the "
        "generation prompt)",
    )
    # --method and --impl are checked by GenerationConfig: a bad value is one line on stderr, exit 2.
    parser.add_argument("--method", default="ddtree", metavar="{" + ",".join(METHODS) + "}")
    parser.add_argument("--budget", type=int, default=32, help="DDTree node budget (root not counted)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (or generation_config)")
    parser.add_argument(
        "--temperature", type=float, default=None, help="default 0: greedy (or generation_config)"
    )
    parser.add_argument("--top-p", type=float, default=None, help="default 1.0: off (or generation_config)")
    parser.add_argument("--top-k", type=int, default=None, help="default 0: off (or generation_config)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop",
        type=int,
        action="append",
        default=None,
        help="stop token id (repeatable); default: the checkpoint's eos_token_id (none in the demo)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="no default stop token")
    parser.add_argument(
        "--stop-string",
        action="append",
        default=None,
        metavar="S",
        help="cut the printed text of a request before the first S (repeatable; see below)",
    )
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
        help="also run DFlash (after DDTree) and autoregressive decoding; report speedups and "
        "whether the outputs match",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="default: bfloat16 on CUDA for checkpoints, float32 otherwise",
    )
    parser.add_argument(
        "--impl",
        default=None,
        metavar="{" + ",".join(IMPLS) + "}",
        help="ref: the torch reference; triton: the Triton kernels; hopper: the Hopper attention kernel "
        "where it applies, Triton elsewhere (default: the fastest that applies)",
    )
    parser.add_argument("--no-stream", action="store_true", help="print the output only at the end")
    parser.add_argument("--no-stage-timing", action="store_true", help="skip the per-stage timers")
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run every decoding round eagerly (default on CUDA with the kernels: rounds are replayed "
        "from CUDA graphs captured after the first one; the tokens are the same)",
    )


def _parse_ids(flag: str, text: str) -> list[int]:
    try:
        return [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
    except ValueError:
        raise ValueError(f"{flag}: expected token ids separated by spaces, got {text!r}") from None


class _TokenizerJson:
    """A tokenizer.json read by `tokenizers` alone, with the part of a transformers tokenizer's interface
    that generate uses (no chat template). Used when transformers is not installed."""

    chat_template = None

    def __init__(self, tok) -> None:
        self.tok = tok
        self.all_special_ids = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]

    @classmethod
    def load(cls, path: Path) -> _TokenizerJson:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type
            raise ValueError(f"tokenizer: cannot read {path}: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _Tokenizer:
    """Text <-> ids through a transformers tokenizer (or tokenizer.json alone when transformers is not
    installed), or space-separated ids when there is none."""

    def __init__(self, tok=None, source: str = "") -> None:
        self.tok, self.source = tok, source

    @classmethod
    def load(cls, model_dir: str, trust_remote_code: bool = False) -> _Tokenizer:
        """The model dir's tokenizer when it has tokenizer files, else the id-only one."""
        if not any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES):
            return cls(None, model_dir)
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            if (Path(model_dir) / "tokenizer.json").is_file() and not trust_remote_code:
                return cls(_TokenizerJson.load(Path(model_dir) / "tokenizer.json"), model_dir)
            missing = getattr(exc, "name", None) or "transformers"
            raise ValueError(
                f"tokenizer: reading the tokenizer files in {model_dir} needs transformers (cannot import "
                f"{missing!r}); it comes with the [hf] extra: {HF_EXTRA}"
            ) from None
        try:
            # trust_remote_code is always given: None would make transformers ask on stdin.
            tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except ModuleNotFoundError as exc:  # e.g. tiktoken or sentencepiece for the tokenizer's own code
            raise ValueError(
                f"tokenizer: the tokenizer in {model_dir} needs the Python module {exc.name!r} "
                "(pip install it)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - anything transformers raises is one line here
            if "trust_remote_code" in str(exc) and not trust_remote_code:
                raise ValueError(
                    f"tokenizer: the tokenizer in {model_dir} is custom code shipped with the checkpoint; "
                    "pass --trust-remote-code to run it"
                ) from None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"tokenizer: cannot load the tokenizer in {model_dir}: {first}") from None
        return cls(tok, model_dir)

    @property
    def all_special_ids(self) -> list[int]:
        return list(getattr(self.tok, "all_special_ids", None) or ()) if self.tok is not None else []

    def encode(self, text: str) -> list[int]:
        if self.tok is not None:
            return list(self.tok.encode(text))
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            msg = f"--prompt: without a tokenizer a prompt is space-separated token ids, got {text!r}"
            raise ValueError(msg) from None

    def check_chat(self, demo: bool) -> None:
        if self.tok is None:
            where = "the demo has no tokenizer" if demo else f"{self.source} has no tokenizer files"
            raise ValueError(f"--chat: needs a tokenizer with a chat template, and {where}")
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(
                f"--chat: the tokenizer in {self.source} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); pass the prompt already formatted"
            )

    def chat(self, text: str) -> list[int]:
        """The chat template applied to one user message, with the generation prompt, as ids (the
        template writes the special tokens, so none are added by the encoding)."""
        messages = [{"role": "user", "content": text}]
        try:
            formatted = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except ImportError as exc:  # transformers renders templates with jinja2
            raise ValueError(f"--chat: applying the chat template needs {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template that raises (e.g. on a role it rejects)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--chat: the chat template of {self.source} failed: {first}") from None
        return list(self.tok.encode(formatted, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tok is None:
            return " ".join(map(str, ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _generation_defaults(model_dir: str) -> dict:
    """Defaults from model_dir/generation_config.json: temperature / top_p / top_k when do_sample is true
    (transformers ignores them otherwise), max_new_tokens, and "stop" from eos_token_id."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object")

    def get(key: str, kind: str):
        v = d.get(key)
        ok = is_int(v) if kind == "an int" else isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and not ok:
            raise ValueError(f"generation_config.json: {key} must be {kind}, got {v!r} ({path})")
        return v

    out = {}
    if d.get("do_sample") is True:
        temperature = get("temperature", "a number")
        out["temperature"] = 1.0 if temperature is None else temperature
        for key, kind in (("top_p", "a number"), ("top_k", "an int")):
            if get(key, kind) is not None:
                out[key] = d[key]
    if get("max_new_tokens", "an int") is not None:
        out["max_new_tokens"] = d["max_new_tokens"]
    eos = d.get("eos_token_id")
    if eos is not None:
        eos = [eos] if not isinstance(eos, list) else eos
        if not all(is_int(t) and t >= 0 for t in eos):
            raise ValueError(f"generation_config.json: eos_token_id must be token ids, got {eos!r} ({path})")
        out["stop"] = tuple(eos)
    return out


def _config(args, defaults: dict | None = None) -> GenerationConfig:
    """The GenerationConfig of the arguments; a flag left out takes defaults[name] (a checkpoint's
    generation_config.json), else DEFAULTS. Stop tokens: --stop only; _load adds a checkpoint's eos."""
    value = {k: getattr(args, k) for k in DEFAULTS}
    for k, v in value.items():
        if v is None:
            value[k] = (defaults or {}).get(k, DEFAULTS[k])
    sampling = SamplingParams(temperature=value["temperature"], top_p=value["top_p"], top_k=value["top_k"])
    return GenerationConfig(
        max_new_tokens=value["max_new_tokens"],
        method=args.method,
        budget=args.budget,
        sampling=sampling,
        seed=args.seed,
        stop_tokens=tuple(args.stop or ()),
        impl=args.impl,
        cuda_graphs=False if args.no_cuda_graphs else None,
    )


def _methods(args) -> list[str]:
    """--compare runs the chosen method, then DFlash (when the method is DDTree) and autoregressive."""
    methods = [args.method]
    if args.compare and args.method == "ddtree":
        methods.append("dflash")
    if args.compare and args.method != "autoregressive":
        methods.append("autoregressive")
    return methods


def _check_impl_device(impl: str | None, device: str) -> None:
    """Triton kernels need a CUDA device (or the interpreter, TRITON_INTERPRET=1, as the tests use)."""
    if kernels_unavailable(impl, "cuda" if device.startswith("cuda") else "cpu"):
        raise ValueError(f"--impl {impl}: needs --device cuda (a CUDA GPU); use --impl ref on the CPU")


def _check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: {name!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is available to torch here; use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class _Session:
    """The loaded models, the tokenizer, the checked prompts, the configuration and the text options."""

    target: object
    drafter: object | None
    tokenizer: _Tokenizer
    prompts: list[list[int]]
    config: GenerationConfig
    stop_strings: tuple[str, ...] = ()
    skip_special_tokens: bool = True


def _prompts(args, tok: _Tokenizer, demo: bool) -> list[list[int]]:
    items = args.prompts or []
    if args.chat:
        tok.check_chat(demo)
    out = []
    for kind, value in items:
        if kind == "ids":
            out.append(_parse_ids("--prompt-ids", value))
        else:
            out.append(tok.chat(value) if args.chat else tok.encode(value))
    return out


def _random_demo(args, config: GenerationConfig, methods: list[str], text: dict) -> _Session:
    """`--demo random`: the seeded tiny random target and a stand-in (or random) drafter, token ids."""
    from kdtree_engine.engine import demo as d

    tok = _Tokenizer(None)
    prompts = _prompts(args, tok, demo=True) or [list(d.DEMO_PROMPT)]
    dtype = DTYPES[args.dtype or "float32"]
    if args.device == "cpu":
        torch.set_num_threads(1)  # a tiny model: more threads only add synchronization
    target = d.demo_target(args.device, dtype)
    cfg = target.config
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)  # before the oracle
    check_stop_tokens(config.stop_tokens, cfg.vocab_size)
    drafter = None
    if methods != ["autoregressive"]:
        drafter = d.demo_drafter(args.demo_drafter or "oracle", target, prompts, config.max_new_tokens)
    return _Session(target, drafter, tok, prompts, config, **text)


def _kimi_nano_args(args) -> argparse.Namespace:
    """The arguments of the default demo: the embedded kimi-nano folders as --model and --drafter and,
    without a prompt, the first held-out code-completion prompt (printed first)."""
    from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH, heldout_prompts

    if args.model is not None or args.drafter is not None:
        raise ValueError("--demo: the demo brings its own model and drafter; drop --model/--drafter")
    args = argparse.Namespace(**vars(args))
    args.model, args.drafter = str(KIMI_NANO), str(KIMI_NANO_DFLASH)
    if not args.prompts:
        prompt = heldout_prompts()[0]
        args.prompts = [("text", prompt["text"])]
        print(f"--- prompt: held-out code from the Python standard library ({prompt['source']}) ---")
        print(prompt["text"])
    return args


def _load(args) -> _Session:
    """Checks every argument that needs no model first (nothing is printed or loaded before), then loads."""
    _check_device(args.device)
    _check_impl_device(args.impl, args.device)
    config = _config(args)  # bad flags fail here, before any file is read
    stop_strings = tuple(args.stop_string or ())
    if any(not s for s in stop_strings):
        raise ValueError("--stop-string: expected a non-empty string")
    text = {"stop_strings": stop_strings, "skip_special_tokens": not args.show_special_tokens}
    methods = _methods(args)
    demo = args.demo or ("kimi-nano" if args.model is None and args.drafter is None else None)
    if args.demo_drafter and demo != "random":
        raise ValueError("--demo-drafter: only with --demo random (kimi-nano has its trained drafter)")
    if demo == "random":
        return _random_demo(args, config, methods, text)
    if demo == "kimi-nano":
        args = _kimi_nano_args(args)
    if args.model is None:
        raise ValueError("--model: a target checkpoint is required unless --demo is given")
    if methods != ["autoregressive"] and not args.drafter:
        raise ValueError(
            f"--drafter: method {args.method!r} needs a DFlash drafter checkpoint "
            "(pass --drafter DIR, or --method autoregressive)"
        )
    if not args.prompts:
        raise ValueError("--prompt: give at least one prompt (--prompt TEXT or --prompt-ids IDS)")
    defaults = _generation_defaults(args.model)
    config = _config(args, defaults)
    tok = _Tokenizer.load(args.model, args.trust_remote_code)
    prompts = _prompts(args, tok, demo=False)
    flags = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k, "stop": args.stop or (() if args.ignore_eos else None)}  # fmt: skip
    taken = [
        f"{k} {v}" if k != "stop" else f"stop tokens {list(v)}"
        for k, v in defaults.items()
        if flags[k] is None
    ]
    if taken:
        _progress(f"generation_config.json: {', '.join(taken)} (flags override)")

    from kdtree_engine.drafter import load_drafter
    from kdtree_engine.model import load_model

    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    _progress(f"loading target from {args.model} ...")
    target = load_model(args.model, dtype=dtype, device=args.device)
    drafter = None
    if args.drafter:
        _progress(f"loading drafter from {args.drafter} ...")
        drafter = load_drafter(args.drafter, dtype=dtype, device=args.device)
    if not (args.stop or args.ignore_eos):  # a checkpoint stops at its eos token by default
        eos = defaults.get("stop", target.config.eos_token_id)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        config = replace(config, stop_tokens=eos)
    cfg = target.config
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
    check_stop_tokens(config.stop_tokens, cfg.vocab_size)
    for method in methods:
        check_drafter(target, drafter, method)
    return _Session(target, drafter, tok, prompts, config, **text)


class _Printer:
    """Prints the requests' texts (see EPILOG): streamed through on_tokens, or all at the end."""

    def __init__(self, session: _Session, stream: bool) -> None:
        self.stream, self.batch = stream, len(session.prompts)
        self.texts = [
            TextStream(session.tokenizer, session.stop_strings, session.skip_special_tokens)
            for _ in range(self.batch)
        ]

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


def _run(session: _Session, method: str, stream: bool, stage_timing: bool) -> GenerationOutput:
    printer = _Printer(session, stream)
    config = replace(session.config, method=method)
    print(f"--- {method}" + (f" (budget {config.budget})" if method == "ddtree" else "") + " ---")
    out = generate(
        session.target,
        session.drafter,
        session.prompts,
        config,
        on_tokens=printer.on_tokens if stream else None,
        stage_timing=stage_timing,
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
        generate(session.target, session.drafter, session.prompts, replace(session.config, method=method))


def _explain(session: _Session, method: str, base: GenerationOutput, out: GenerationOutput) -> bool:
    """Prints where each differing request parted from autoregressive decoding and whether the target's
    logits there nearly tie (engine.compare); True when every difference is such a tie."""
    from kdtree_engine.engine.compare import explain

    found = explain(session.target, session.prompts, base.tokens, out.tokens, impl=session.config.impl)
    for d in found:
        print(f"{method:>8}: {d.describe()}")
    return all(d.tie for d in found)


def _compare(runs: dict[str, GenerationOutput], greedy: bool, session: _Session | None = None) -> int:
    """Exit code 1 when a greedy output differs from autoregressive decoding's in a way that a near-tie
    of the target's logits (rounding of a verify forward against a decode step) does not explain."""
    base = runs["autoregressive"]
    print("--- compare with autoregressive ---")
    same_all = True
    for method, out in runs.items():
        if method == "autoregressive":
            continue
        same = out.tokens == base.tokens
        speed = base.stats.wall_time / out.stats.wall_time if out.stats.wall_time else float("nan")
        fwd = base.stats.target_forwards / max(out.stats.target_forwards, 1)
        verdict = ("identical: YES" if same else "identical: NO") if greedy else "sampled"
        print(
            f"{method:>8}: target forwards {out.stats.target_forwards} vs {base.stats.target_forwards} "
            f"({fwd:.2f}x fewer), mean accepted length {out.stats.mean_accept_len:.2f}, "
            f"wall time speedup {speed:.2f}x, output {verdict}"
        )
        if greedy and not same:
            same_all &= session is not None and _explain(session, method, base, out)
    if not greedy:
        print("(sampled outputs are not expected to be identical; their distribution is the target's)")
        return 0
    return 0 if same_all else 1


def main(args: argparse.Namespace) -> int:
    try:
        session = _load(args)
        methods = _methods(args)
        timing = not args.no_stage_timing
        if len(methods) > 1:
            _warm_up(session, methods)
        runs = {m: _run(session, m, not args.no_stream, timing) for m in methods}
    except ValueError as exc:
        print(f"kdtree-engine generate: {exc}", file=sys.stderr)
        return 2
    if "autoregressive" in runs and len(runs) > 1:
        return _compare(runs, greedy=session.config.sampling.greedy, session=session)
    return 0
