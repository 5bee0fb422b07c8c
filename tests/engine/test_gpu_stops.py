"""Stop strings with CUDA graphs on: the request whose text completes a stop string finishes at that
token while the others of the batch run on, as after a stop token; the rounds are replayed from graphs
(the stand-in drafter is capturable). Greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, SamplingParams, generate
from kdtree_engine.engine.demo import demo_drafter, demo_target
from kdtree_engine.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu
IDS = Tokenizer(None)
PROMPTS = [[1, 17, 42, 5], [9, 8, 7, 6, 5, 4], [3, 3, 3]]


def _kept(ids: list[int], stop: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if stop in IDS.decode(ids[:k]))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20)])
@pytest.mark.parametrize("method", ["ddtree", "dflash", "autoregressive"])
def test_stop_strings_with_cuda_graphs(method, sampling):
    target = demo_target("cuda", torch.float32)
    n = 40
    drafter = demo_drafter("oracle", target, PROMPTS, n)
    base = GenerationConfig(max_new_tokens=n, method=method, budget=16, sampling=sampling, seed=3)
    full = generate(target, drafter, PROMPTS, base).tokens
    stop = " ".join(map(str, full[1][6:8]))  # request 1's 7th and 8th tokens
    kept = _kept(full[1], stop)
    config = GenerationConfig(
        max_new_tokens=n, method=method, budget=16, sampling=sampling, seed=3, stop_strings=(stop,)
    )
    out = generate(target, drafter, PROMPTS, config, tokenizer=IDS)
    assert out.stats.cuda_graphs
    for b, tokens in enumerate(full):
        want = tokens[: _kept(tokens, stop)] if stop in IDS.decode(tokens) else tokens
        assert out.tokens[b] == want, b
    assert len(out.tokens[1]) == kept <= 8 and out.stats.new_tokens == [len(t) for t in out.tokens]
