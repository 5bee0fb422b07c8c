"""Golden cases for the generation engine: a seeded float64 tiny target and the demo drafters; the
stored outputs are greedy token streams and target-forward counts. float64 keeps argmax ties from
turning on the last bits of a machine's BLAS."""

from __future__ import annotations

import torch

# name -> (method, budget, drafter kind, prompts, new tokens)
CASES: dict[str, tuple[str, int, str, list[list[int]], int]] = {
    "engine_autoregressive": ("autoregressive", 0, "oracle", [[1, 17, 42, 5], [99, 23]], 12),
    "engine_ddtree_oracle": ("ddtree", 8, "oracle", [[1, 17, 42, 5], [99, 23]], 12),
    "engine_ddtree_random_drafter": ("ddtree", 4, "random", [[7, 3, 11]], 8),
}


def run_case(name: str, impl: str | None = None):
    """Runs the case; returns (prompts, GenerationOutput)."""
    from kdtree_engine.engine import generate
    from kdtree_engine.engine.demo import demo_drafter, demo_target

    method, budget, kind, prompts, n = CASES[name]
    target = demo_target(dtype=torch.float64)
    drafter = demo_drafter(kind, target, prompts, n, block_size=8)
    out = generate(target, drafter, prompts, n, method=method, budget=budget or None, impl=impl)
    return prompts, out


def make_case(name: str) -> tuple[dict[str, torch.Tensor], int, dict]:
    prompts, out = run_case(name, impl="ref")
    width = max(len(t) for t in out.tokens)
    tokens = torch.full((len(out.tokens), width), -1, dtype=torch.long)
    for r, toks in enumerate(out.tokens):
        tokens[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    tensors = {
        "out.tokens": tokens,
        "out.target_forwards": torch.tensor([out.stats.target_forwards]),
    }
    method, budget, kind, _, n = CASES[name]
    params = {"method": method, "budget": budget, "drafter": kind, "prompts": prompts, "new_tokens": n}
    return tensors, 0, params
