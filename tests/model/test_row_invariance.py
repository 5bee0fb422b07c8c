"""The model's row-invariant mode (`row_invariant=True` in the forward, issue 32), on the CPU through
the Triton interpreter: a tree verify forward gives every node the logits, bit for bit, that the same
token gets when its path is decoded one token at a time, and the cache rows it writes are the ones
those steps write (float32 and bf16); a request gets the same logits alone and batched. The prompt (66
tokens) crosses the kernels' 64-position tile, and the attention's splits are set to 64 positions so
that several take part. Without the mode the same comparison fails in float32 (checked here, so the
test can tell; in bf16 at this tiny size the rounding of the logits hides the differences)."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.bench.attention import _tree_visibility
from kdtree_engine.kernels import mla_attention_triton
from kdtree_engine.model.model import DeepseekV3ForCausalLM
from kdtree_engine.model.testing import randomize_, tiny_config

PROMPT, NODES = 66, 5


@pytest.fixture(autouse=True)
def _small_splits(monkeypatch):
    monkeypatch.setattr(mla_attention_triton, "INVARIANT_CHUNK", 64)


def _model(dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    return randomize_(DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=2)), seed=0).to(dtype)


def _tree(batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 128, (batch, PROMPT), generator=gen)
    tokens = torch.randint(2, 128, (batch, NODES), generator=gen)
    vis = _tree_visibility(batch, NODES, gen)
    return prompt, tokens, vis


def _verify(model, prompt, tokens, vis, invariant: bool):
    """Prefill the prompts, then one verify forward of the trees: (logits [b, t, V], cache)."""
    b = prompt.shape[0]
    cache = model.new_cache(b, PROMPT + NODES + 4)
    model(prompt, cache, impl="triton", row_invariant=invariant)
    depth = vis.sum(-1) - 1
    out = model(
        tokens, cache, positions=PROMPT + depth, visibility=vis, impl="triton", row_invariant=invariant
    )
    return out.logits, cache


def _path(model, prompt, tokens, vis, r: int, i: int, invariant: bool):
    """Node i of request r decoded as a path: the prompt, then its ancestors one token at a time.
    Returns (logits [V] of the last step, the cache rows of the path [layers, path, d])."""
    cache = model.new_cache(1, PROMPT + NODES + 4)
    model(prompt[r : r + 1], cache, impl="triton", row_invariant=invariant)
    ancestors = vis[r, i].nonzero().flatten()
    for a in ancestors:
        logits = model(tokens[r : r + 1, a : a + 1], cache, impl="triton", row_invariant=invariant).logits
    return logits[0, 0], cache.kv[:, 0, PROMPT : PROMPT + len(ancestors)], ancestors


def _differing_nodes(model, batch: int, seed: int, invariant: bool = True) -> int:
    prompt, tokens, vis = _tree(batch, seed)
    logits, cache = _verify(model, prompt, tokens, vis, invariant)
    differing = 0
    for r in range(batch):
        for i in range(NODES):
            step, path_rows, ancestors = _path(model, prompt, tokens, vis, r, i, invariant)
            same_rows = torch.equal(cache.kv[:, r, PROMPT + ancestors], path_rows)
            differing += not (torch.equal(logits[r, i], step) and same_rows)
    return differing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tree_nodes_get_the_logits_of_their_decoded_paths(dtype):
    assert _differing_nodes(_model(dtype), batch=2, seed=1) == 0


def test_without_the_mode_the_same_comparison_fails():
    assert _differing_nodes(_model(torch.float32), batch=2, seed=1, invariant=False) > 0


def test_a_request_gets_the_same_logits_alone_and_batched():
    model = _model(torch.float32)
    prompt, tokens, vis = _tree(3, seed=2)
    batched, _ = _verify(model, prompt, tokens, vis, True)
    for r in range(3):
        alone, _ = _verify(model, prompt[r : r + 1], tokens[r : r + 1], vis[r : r + 1], True)
        assert torch.equal(alone[0], batched[r]), f"request {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tree_nodes_get_the_logits_of_their_decoded_paths_on_the_gpu(dtype):
    """The same on CUDA (compiled kernels, the Hopper attention kernel set aside by the mode)."""
    assert _differing_nodes(_model(dtype).cuda(), batch=3, seed=3) == 0
