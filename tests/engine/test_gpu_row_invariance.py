"""Issue 32 on the GPU: with the row-invariant mode (`GenerationConfig(row_invariant=True)`), a greedy
request's tokens in bf16 are those of autoregressive decoding of its prompt alone, whatever batch it runs
in (64 requests, prompts repeated at other rows), whatever the method (DFlash, DDTree at a fixed budget,
budget "auto") and with CUDA graphs or without.

Two targets: the shipped kimi-nano with its trained drafter, and the scaled-down Kimi shape (2.5B, random
weights, `bench.e2e_small`) without the successor margin its benchmark gives it, so that its top two
logits are often closer than bf16 rounding: there a token computed in another order than alone would
come out different, which is what the mode must prevent. Each test also reports (not asserts) how many
requests differ from their alone run without the mode, the difference the mode removes."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, generate
from tests.engine.helpers import report_line

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
IMPL = None  # the kernels CUDA picks
NEW_TOKENS = 40
BATCH = 64


def _nano():
    from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
    from kdtree_engine.bench.e2e_nano import nano_prompts
    from kdtree_engine.drafter import load_drafter
    from kdtree_engine.model import load_model

    target = load_model(KIMI_NANO, dtype=torch.bfloat16, device=DEVICE)
    drafter = load_drafter(KIMI_NANO_DFLASH, dtype=torch.bfloat16, device=DEVICE)
    return target, lambda alone, rows: drafter, nano_prompts(8)


def _small():
    from kdtree_engine.bench.e2e_small import kimi_small_config, random_target
    from kdtree_engine.engine.demo import NoisyOracleDrafter

    target = random_target(kimi_small_config(), DEVICE, successor_scale=0.0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.config.vocab_size, (8, 16), generator=gen).tolist()

    def drafter(alone, rows):  # proposes row k's prompt's autoregressive continuation, noisily ranked
        horizon = [prompts[k % len(alone)] + alone[k % len(alone)] for k in range(rows)]
        return NoisyOracleDrafter(horizon, target.config.vocab_size, block_size=16, device=DEVICE)

    return target, drafter, prompts


@pytest.fixture(scope="module", params=["nano", "small"])
def setup(request):
    target, drafter_for, prompts = _nano() if request.param == "nano" else _small()
    alone = [_tokens(target, None, [p], "autoregressive")[0] for p in prompts]
    yield request.param, target, lambda rows: drafter_for(alone, rows), prompts, alone
    del target
    torch.cuda.empty_cache()


def _tokens(target, drafter, prompts, method, budget=None, graphs=None, invariant=True):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, method=method, budget=budget, cuda_graphs=graphs,
                              impl=IMPL, row_invariant=invariant)  # fmt: skip
    out = generate(target, drafter if method != "autoregressive" else None, prompts, config)
    assert out.stats.cuda_graphs == (graphs is not False and DEVICE == "cuda")
    return out.tokens


def _differing(tokens, alone) -> list[int]:
    """Rows whose tokens are not their prompt's alone run (row k runs prompt k mod len(alone))."""
    return [k for k, t in enumerate(tokens) if t != alone[k % len(alone)]]


@pytest.mark.parametrize(
    "method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 32), ("ddtree", "auto")]
)
def test_a_request_gets_its_alone_tokens_in_a_batch_of_64(setup, method, budget):
    name, target, drafter_for, prompts, alone = setup
    batch = [prompts[k % len(prompts)] for k in range(BATCH)]
    drafter = drafter_for(BATCH)
    differing = _differing(_tokens(target, drafter, batch, method, budget), alone)
    plain = _differing(_tokens(target, drafter, batch, method, budget, invariant=False), alone)
    report_line(f"row invariance, {name}, batch {BATCH}, {method} {budget}: {len(differing)} of {BATCH} "
                f"requests differ from their alone run with the mode, {len(plain)} without it")  # fmt: skip
    assert differing == [], f"{name} {method} {budget}: requests {differing} differ from their alone run"


@pytest.mark.parametrize("method,budget", [("autoregressive", None), ("dflash", None), ("ddtree", 16)])
def test_eager_and_captured_rounds_give_the_alone_tokens(setup, method, budget):
    name, target, drafter_for, prompts, alone = setup
    drafter = drafter_for(len(prompts))
    eager = _tokens(target, drafter, prompts, method, budget, graphs=False)
    captured = _tokens(target, drafter, prompts, method, budget, graphs=True)
    assert _differing(eager, alone) == [], f"{name} {method} {budget}: eager"
    assert _differing(captured, alone) == [], f"{name} {method} {budget}: captured"
