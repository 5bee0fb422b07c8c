"""Replay the committed engine bundles: greedy token streams and target-forward counts of a seeded
float64 tiny target must not change. DDTree's stream must also equal the stored autoregressive one."""

from pathlib import Path

import pytest
import torch

from kdtree_engine.golden import read_bundle
from kdtree_engine.golden.engine_cases import CASES, run_case

HERE = Path(__file__).parent


def stored_tokens(name: str) -> list[list[int]]:
    tokens = read_bundle(HERE / f"{name}.safetensors").tensors["out.tokens"]
    return [[x for x in row if x >= 0] for row in tokens.tolist()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay(name):
    bundle = read_bundle(HERE / f"{name}.safetensors")
    assert bundle.meta["op"] == "engine"
    _, out = run_case(name, impl="ref")
    assert out.tokens == stored_tokens(name)
    assert torch.equal(torch.tensor([out.stats.target_forwards]), bundle.tensors["out.target_forwards"])


def test_ddtree_bundle_equals_autoregressive_bundle():
    assert stored_tokens("engine_ddtree_oracle") == stored_tokens("engine_autoregressive")
    forwards = {n: int(read_bundle(HERE / f"{n}.safetensors").tensors["out.target_forwards"]) for n in CASES}
    assert forwards["engine_ddtree_oracle"] < forwards["engine_autoregressive"]
