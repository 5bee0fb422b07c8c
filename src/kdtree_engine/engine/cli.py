"""`kdtree-engine generate`: stream tokens from autoregressive, DFlash or DDTree decoding and print stats.

With --model/--drafter it loads HF-format checkpoints (tokenizer files in the model dir are used when
present, else prompts are space-separated token ids). With --demo (or neither path) it runs on a seeded
tiny random target and a demo drafter: no download, CPU is enough.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kdtree_engine.engine.checks import METHODS, check_prompts
from kdtree_engine.engine.loop import GenerationOutput, generate

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
    parser.add_argument("--method", choices=METHODS, default="ddtree")
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
        choices=("ref", "triton"),
        default=None,
        help="default: triton kernels on CUDA, reference on CPU",
    )
    parser.add_argument("--no-stream", action="store_true", help="print the output only at the end")
    parser.add_argument(
        "--no-stage-timing", action="store_true", help="skip per-stage timers (no CUDA syncs between stages)"
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


def _load(args, prompts_text):
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
        if args.method != "autoregressive" or args.compare:
            drafter = d.demo_drafter(args.demo_drafter, target, prompts, args.max_new_tokens)
        return target, drafter, tok, prompts
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
    return target, drafter, tok, [tok.encode(p) for p in prompts_text]


def _stop_tokens(args, target) -> list[int]:
    if args.stop or args.ignore_eos or args.demo or args.model is None:
        return list(args.stop or ())
    eos = target.config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _run(args, target, drafter, prompts, method, tok, stream: bool) -> GenerationOutput:
    seen: list[int] = []
    shown = [""]

    def on_tokens(b: int, toks: list[int]) -> None:
        # Decode the whole output and print the new suffix: a piece decoded alone can lose its spacing.
        seen.extend(toks)
        text = tok.decode(seen)
        sys.stdout.write(text[len(shown[0]) :] if text.startswith(shown[0]) else " " + text)
        sys.stdout.flush()
        shown[0] = text

    print(f"--- {method}" + (f" (budget {args.budget})" if method == "ddtree" else "") + " ---")
    out = generate(
        target,
        drafter,
        prompts,
        args.max_new_tokens,
        method=method,
        budget=args.budget,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_tokens=_stop_tokens(args, target),
        impl=args.impl,
        on_tokens=on_tokens if stream else None,
        stage_timing=not args.no_stage_timing,
    )
    if stream:
        print()
    else:
        for b, t in enumerate(out.tokens):
            print(f"[{b}] {tok.decode(t)}")
    print(out.stats.summary())
    return out


def _compare(args, runs: dict[str, GenerationOutput]) -> int:
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
        verdict = "sampled" if args.temperature > 0 else ("identical: YES" if same else "identical: NO")
        print(
            f"{method:>8}: target forwards {out.stats.target_forwards} vs {base.stats.target_forwards} "
            f"({fwd:.2f}x fewer), mean accepted length {out.stats.mean_accept_len:.2f}, "
            f"wall time speedup {speed:.2f}x, output {verdict}"
        )
    if args.temperature > 0:
        print("(sampled outputs are not expected to be identical; their distribution is the target's)")
        return 0
    return 0 if same_all else 1


def main(args: argparse.Namespace) -> int:
    """--compare runs the chosen method, then DFlash (when the method is DDTree) and autoregressive."""
    try:
        target, drafter, tok, prompts = _load(args, args.prompt)
        stream = not args.no_stream and len(prompts) == 1
        methods = [args.method]
        if args.compare and args.method == "ddtree":
            methods.append("dflash")
        if args.compare and args.method != "autoregressive":
            methods.append("autoregressive")
        runs = {m: _run(args, target, drafter, prompts, m, tok, stream) for m in methods}
    except ValueError as exc:
        print(f"kdtree-engine generate: {exc}", file=sys.stderr)
        return 2
    return _compare(args, runs) if "autoregressive" in runs and len(runs) > 1 else 0
