"""Golden cases for the generation engine: a seeded float64 tiny target and the demo drafters; the
stored outputs are greedy token streams and target-forward counts. float64 keeps argmax ties from
turning on the last bits of a machine's BLAS."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineCase:
    method: str
    budget: int  # DDTree nodes; 0 here means the default (block_size - 1)
    drafter: str  # demo drafter kind: "oracle" or "random"
    prompts: list[list[int]]
    new_tokens: int


CASES: dict[str, EngineCase] = {
    "engine_autoregressive": EngineCase("autoregressive", 0, "oracle", [[1, 17, 42, 5], [99, 23]], 12),
    "engine_ddtree_oracle": EngineCase("ddtree", 8, "oracle", [[1, 17, 42, 5], [99, 23]], 12),
    "engine_ddtree_random_drafter": EngineCase("ddtree", 4, "random", [[7, 3, 11]], 8),
}


def run_case(name: str, impl: str | None = None):
    """Runs the case; returns (prompts, GenerationOutput)."""
    from kdtree_engine.engine import GenerationConfig, generate
    from kdtree_engine.engine.demo import demo_drafter, demo_target

    case = CASES[name]
    target = demo_target(dtype=torch.float64)
    drafter = demo_drafter(case.drafter, target, case.prompts, case.new_tokens, block_size=8)
    config = GenerationConfig(
        max_new_tokens=case.new_tokens, method=case.method, budget=case.budget or None, impl=impl
    )
    return case.prompts, generate(target, drafter, case.prompts, config)


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
    case = CASES[name]
    params = {
        "method": case.method,
        "budget": case.budget,
        "drafter": case.drafter,
        "prompts": prompts,
        "new_tokens": case.new_tokens,
    }
    return tensors, 0, params
