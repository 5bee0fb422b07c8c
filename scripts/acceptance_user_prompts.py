"""Acceptance of the shipped kimi-nano pair on hand-written prompts (assets/user_prompts.json, in no
corpus) against its held-out corpus prompts: CPU float32, greedy, one batch per prompt set; per method
(DFlash's chain, DDTree at the budget) the mean accepted length over every (request, round) and how
many outputs equal autoregressive decoding. Issue 30's bar: on the hand-written prompts, budget 32, 64
new tokens, DDTree >= 4.0 and >= 1.3x DFlash, every output equal.

    python scripts/acceptance_user_prompts.py [--budget 32] [--new-tokens 64] [--target DIR --drafter DIR]

--target and --drafter measure another pair (a retrained one, before it replaces the shipped assets);
the held-out corpus prompts are the target folder's heldout_prompts.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kdtree_engine.assets import KIMI_NANO, heldout_prompts, user_prompts
from kdtree_engine.bench.e2e_nano import drafter_path, nano_drafter
from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.engine.tokenizer import load_tokenizer
from kdtree_engine.model import load_model


def acceptance(target, drafter, prompts: list[list[int]], budget: int, new_tokens: int) -> dict[str, str]:
    """Per method: 'mean accepted length (equal to autoregressive / requests)'."""
    config = GenerationConfig(method="autoregressive", max_new_tokens=new_tokens)
    base = generate(target, None, prompts, config)
    cells = {}
    for method in ("dflash", "ddtree"):
        config = GenerationConfig(method=method, budget=budget, max_new_tokens=new_tokens)
        out = generate(target, drafter, prompts, config)
        equal = sum(a == b for a, b in zip(out.tokens, base.tokens))
        cells[method] = f"{out.stats.mean_accept_len:.2f} ({equal}/{len(prompts)} equal)"
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--target", default=str(KIMI_NANO), help="target folder (default: the shipped one)")
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(args.target, dtype=torch.float32, device=torch.device("cpu"))
    tokenizer = load_tokenizer(args.target)
    drafter, _ = nano_drafter(drafter_path(args.drafter), target, tokenizer.token_id("<|mask|>"))
    sets = {"hand-written": user_prompts(), "held-out corpus": heldout_prompts(Path(args.target))}
    print(f"{args.target}, CPU float32, greedy, budget {args.budget}, {args.new_tokens} new tokens")
    print("| prompts | count | DFlash tau | DDTree tau |\n|---|---|---|---|")
    for name, prompts in sets.items():
        ids = [tokenizer.encode(p["text"]) for p in prompts]
        cells = acceptance(target, drafter, ids, args.budget, args.new_tokens)
        print(f"| {name} | {len(ids)} | {cells['dflash']} | {cells['ddtree']} |", flush=True)


if __name__ == "__main__":
    main()
