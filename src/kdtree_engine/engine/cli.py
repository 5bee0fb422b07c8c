"""`kdtree-engine generate`: stream tokens from autoregressive, DFlash or DDTree decoding and print stats.

With --model/--drafter it loads HF-format checkpoints (tokenizer files in the model dir are used when
present, else prompts are space-separated token ids). With --demo (or neither path) it runs on a seeded
tiny random target and a demo drafter: no download, CPU is enough.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kdtree_engine.engine.checks import check_prompts
from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.loop import GenerationOutput, generate
from kdtree_engine.engine.sampling import SamplingParams
from kdtree_engine.impl import IMPLS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target checkpoint dir (HF DeepSeek-V3 / Kimi-K2 format)")
    parser.add_argument("--drafter", help="DFlash drafter checkpoint dir (config.json + safetensors)")
    parser.add_argument("--demo", action="store_true", help="tiny random target + demo drafter, no download")
    parser.add_argument(
        "--demo-drafter",
        choices=("oracle", "random"),
        default="oracle",
        help="demo drafter: a noisy oracle stand-in (default) or a random DFlash drafter",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        help="prompt text (token ids separated by spaces without a tokenizer); repeat for a batch",
    )
    # --method and --impl are checked by GenerationConfig: a bad value is one line on stderr, exit 2.
    parser.add_argument("--method", default="ddtree", metavar="{" + ",".join(METHODS) + "}")
    parser.add_argument("--budget", type=int, default=32, help="DDTree node budget (root not counted)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
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


class _Tokenizer:
    """Text <-> ids through the model dir's tokenizer, or space-separated ids when there is none."""

    def __init__(self, model_dir: str | None) -> None:
        self.tok = None
        if model_dir and any(
            (Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(model_dir)

    def encode(self, text: str) -> list[int]:
        if self.tok is not None:
            return list(self.tok.encode(text))
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            msg = f"--prompt: without a tokenizer a prompt is space-separated token ids, got {text!r}"
            raise ValueError(msg) from None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.tok is not None else " ".join(map(str, ids))


def _config(args) -> GenerationConfig:
    """The GenerationConfig of the arguments (stop tokens: --stop only; _load adds a checkpoint's eos)."""
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        method=args.method,
        budget=args.budget,
        sampling=sampling,
        seed=args.seed,
        stop_tokens=tuple(args.stop or ()),
        impl=args.impl,
        cuda_graphs=False if args.no_cuda_graphs else None,
    )


@dataclass
class _Session:
    """The loaded models, the tokenizer, the checked prompts and the configuration to run."""

    target: object
    drafter: object | None
    tokenizer: _Tokenizer
    prompts: list[list[int]]
    config: GenerationConfig


def _load(args, config: GenerationConfig) -> _Session:
    prompts_text = args.prompt
    demo = args.demo or (args.model is None and args.drafter is None)
    if demo:
        from kdtree_engine.engine import demo as d

        dtype = DTYPES[args.dtype or "float32"]
        if args.device == "cpu":
            torch.set_num_threads(1)  # a tiny model: more threads only add synchronization
        target = d.demo_target(args.device, dtype)
        tok = _Tokenizer(None)
        prompts = [tok.encode(p) for p in prompts_text] if prompts_text else [list(d.DEMO_PROMPT)]
        cfg = target.config
        prompts = check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)  # before the oracle
        drafter = None
        if config.method != "autoregressive" or args.compare:
            drafter = d.demo_drafter(args.demo_drafter, target, prompts, config.max_new_tokens)
        return _Session(target=target, drafter=drafter, tokenizer=tok, prompts=prompts, config=config)
    if args.model is None:
        raise ValueError("--model: a target checkpoint is required unless --demo is given")
    from kdtree_engine.drafter import load_drafter
    from kdtree_engine.model import load_model

    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    target = load_model(args.model, dtype=dtype, device=args.device)
    drafter = load_drafter(args.drafter, dtype=dtype, device=args.device) if args.drafter else None
    tok = _Tokenizer(args.model)
    if not prompts_text:
        raise ValueError("--prompt: give at least one prompt")
    if not (args.stop or args.ignore_eos):  # a checkpoint stops at its eos token by default
        eos = target.config.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        config = replace(config, stop_tokens=eos)
    prompts = [tok.encode(p) for p in prompts_text]
    return _Session(target=target, drafter=drafter, tokenizer=tok, prompts=prompts, config=config)


def _run(session: _Session, method: str, stream: bool, stage_timing: bool) -> GenerationOutput:
    seen: list[int] = []
    shown = [""]
    tok = session.tokenizer

    def on_tokens(b: int, toks: list[int]) -> None:
        # Decode the whole output and print the new suffix: a piece decoded alone can lose its spacing.
        seen.extend(toks)
        text = tok.decode(seen)
        sys.stdout.write(text[len(shown[0]) :] if text.startswith(shown[0]) else " " + text)
        sys.stdout.flush()
        shown[0] = text

    config = replace(session.config, method=method)
    print(f"--- {method}" + (f" (budget {config.budget})" if method == "ddtree" else "") + " ---")
    out = generate(
        session.target,
        session.drafter,
        session.prompts,
        config,
        on_tokens=on_tokens if stream else None,
        stage_timing=stage_timing,
    )
    if stream:
        print()
    else:
        for b, t in enumerate(out.tokens):
            print(f"[{b}] {tok.decode(t)}")
    print(out.stats.summary())
    return out


def _warm_up(session: _Session, methods: list[str]) -> None:
    """On a GPU, one untimed run per method first, so that no timed run pays for compiling kernels."""
    if session.target.device.type != "cuda":
        return
    print("(GPU: one untimed warm-up run per method compiles the kernels first)")
    for method in methods:
        generate(session.target, session.drafter, session.prompts, replace(session.config, method=method))


def _compare(runs: dict[str, GenerationOutput], greedy: bool) -> int:
    """Exit code 1 when a greedy output differs from autoregressive decoding's."""
    base = runs["autoregressive"]
    print("--- compare with autoregressive ---")
    same_all = True
    for method, out in runs.items():
        if method == "autoregressive":
            continue
        same = out.tokens == base.tokens
        same_all &= same
        speed = base.stats.wall_time / out.stats.wall_time if out.stats.wall_time else float("nan")
        fwd = base.stats.target_forwards / max(out.stats.target_forwards, 1)
        verdict = ("identical: YES" if same else "identical: NO") if greedy else "sampled"
        print(
            f"{method:>8}: target forwards {out.stats.target_forwards} vs {base.stats.target_forwards} "
            f"({fwd:.2f}x fewer), mean accepted length {out.stats.mean_accept_len:.2f}, "
            f"wall time speedup {speed:.2f}x, output {verdict}"
        )
    if not greedy:
        print("(sampled outputs are not expected to be identical; their distribution is the target's)")
        return 0
    return 0 if same_all else 1


def main(args: argparse.Namespace) -> int:
    """--compare runs the chosen method, then DFlash (when the method is DDTree) and autoregressive."""
    try:
        session = _load(args, _config(args))
        stream = not args.no_stream and len(session.prompts) == 1
        methods = [args.method]
        if args.compare and args.method == "ddtree":
            methods.append("dflash")
        if args.compare and args.method != "autoregressive":
            methods.append("autoregressive")
        timing = not args.no_stage_timing
        if len(methods) > 1:
            _warm_up(session, methods)
        runs = {m: _run(session, m, stream, timing) for m in methods}
    except ValueError as exc:
        print(f"kdtree-engine generate: {exc}", file=sys.stderr)
        return 2
    if "autoregressive" in runs and len(runs) > 1:
        return _compare(runs, greedy=session.config.sampling.greedy)
    return 0
