"""A verify forward given its tree as ancestor bits beside the visibility (model.forward(ancestor_bits=)):
the same logits and cache rows as the visibility alone, the kernel path's attention planned with the
bits (one word per query row) and the reference path with the visibility, bad bits refused, and the
engine's verify forwards passing the bits of their compiled trees."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.model import context as model_context
from kdtree_engine.model import random_model, tiny_config
from kdtree_engine.model.model import DeepseekV3ForCausalLM
from kdtree_engine.ref.sglang_attention import visibility_to_bits
from tests.engine.helpers import random_prompts, tiny_drafter, tiny_target

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_visibility(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """[b, t, t] bool of random trees: node 0 the root, node i's parent a random earlier node."""
    vis = torch.zeros(b, t, t, dtype=torch.bool)
    for r in range(b):
        vis[r, 0, 0] = True
        for i in range(1, t):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            vis[r, i] = vis[r, parent]
            vis[r, i, i] = True
    return vis


def _verify(model, vis, bits, impl, t):
    """A ragged prefill (b = 2), then a verify of t tree nodes: (logits, the cache's rows)."""
    gen = torch.Generator().manual_seed(5)
    cache = model.new_cache(2, 7 + t)
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=gen).to(DEVICE)
    model(prompt, cache, lengths=torch.tensor([7, 4], device=DEVICE), impl=impl)
    ids = torch.randint(0, model.config.vocab_size, (2, t), generator=gen).to(DEVICE)
    out = model(ids, cache, visibility=vis.to(DEVICE), ancestor_bits=bits, impl=impl)
    return out.logits, cache.kv


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("t", [5, 33])
def test_bits_give_the_logits_of_the_visibility(impl, t):
    model = random_model(tiny_config(num_hidden_layers=2)).to(DEVICE)
    vis = random_visibility(2, t, torch.Generator().manual_seed(t))
    bits = visibility_to_bits(vis).to(DEVICE)
    logits_vis, kv_vis = _verify(model, vis, None, impl, t)
    logits_bits, kv_bits = _verify(model, vis, bits, impl, t)
    assert torch.equal(logits_bits, logits_vis)
    torch.testing.assert_close(kv_bits, kv_vis, rtol=0, atol=0, equal_nan=True)  # unused rows hold NaN


def _planned_tree(monkeypatch, impl) -> list[str]:
    """The tree argument each plan of a t = 9 verify received ("bits" or "visibility")."""
    seen = []
    plan = model_context.plan_attention

    def recording(*args, **kwargs):
        seen.append("bits" if kwargs.get("ancestor_bits") is not None else "visibility")
        return plan(*args, **kwargs)

    monkeypatch.setattr(model_context, "plan_attention", recording)
    model = random_model(tiny_config(num_hidden_layers=2)).to(DEVICE)
    vis = random_visibility(2, 9, torch.Generator().manual_seed(1))
    _verify(model, vis, visibility_to_bits(vis).to(DEVICE), impl, 9)
    return seen


def test_the_kernel_path_plans_with_the_bits_and_the_reference_with_the_visibility(monkeypatch):
    assert _planned_tree(monkeypatch, "triton")[-1] == "bits"
    assert _planned_tree(monkeypatch, "ref")[-1] == "visibility"


def test_the_row_invariant_mode_keeps_the_visibility(monkeypatch):
    seen = []
    plan = model_context.plan_attention
    monkeypatch.setattr(
        model_context, "plan_attention", lambda *a, **k: seen.append(k.get("ancestor_bits")) or plan(*a, **k)
    )
    model = random_model(tiny_config(num_hidden_layers=1)).to(DEVICE)
    vis = random_visibility(1, 4, torch.Generator().manual_seed(2))
    cache = model.new_cache(1, 4)
    ids = torch.zeros(1, 4, dtype=torch.long, device=DEVICE)
    model(ids, cache, visibility=vis.to(DEVICE), ancestor_bits=visibility_to_bits(vis).to(DEVICE),
          impl="triton", row_invariant=True)  # fmt: skip
    assert seen == [None]


def _bad_bits(b, t, vis):
    good = visibility_to_bits(vis)
    wrong = good.clone()
    wrong[0, t - 1] ^= 1  # the last node no longer sees the root
    return {
        "without visibility": (None, good),
        "wrong shape": (vis, good[:, :-1]),
        "int32": (vis, good.int()),
        "another tree": (vis, wrong),
    }


@pytest.mark.parametrize("case", ["without visibility", "wrong shape", "int32", "another tree"])
def test_bad_bits_are_refused_naming_the_argument(case):
    model = random_model(tiny_config(num_hidden_layers=1))
    vis = random_visibility(2, 4, torch.Generator().manual_seed(3))
    visibility, bits = _bad_bits(2, 4, vis)[case]
    with pytest.raises(ValueError, match="ancestor_bits"):
        model(torch.zeros(2, 4, dtype=torch.long), model.new_cache(2, 4), visibility=visibility,
              ancestor_bits=bits)  # fmt: skip


def test_a_tree_of_more_than_64_tokens_has_no_bits():
    model = random_model(tiny_config(num_hidden_layers=1))
    vis = torch.eye(65, dtype=torch.bool)[None]
    with pytest.raises(ValueError, match="ancestor_bits"):
        model(torch.zeros(1, 65, dtype=torch.long), model.new_cache(1, 65), visibility=vis,
              ancestor_bits=torch.zeros(1, 65, dtype=torch.long))  # fmt: skip


def test_the_engine_verifies_with_the_bits_of_its_trees(monkeypatch):
    """Every verify forward of a DDTree call gets bits, equal to its visibility (checked by the forward
    itself with validation on: the engine's forwards skip it, so it is switched on here)."""
    calls = []
    forward = DeepseekV3ForCausalLM.forward

    def checked(self, input_ids, cache, *args, **kwargs):
        if kwargs.get("visibility") is not None:
            calls.append(kwargs.get("ancestor_bits") is not None)
            kwargs["validate"] = True
        return forward(self, input_ids, cache, *args, **kwargs)

    monkeypatch.setattr(DeepseekV3ForCausalLM, "forward", checked)
    target, drafter = tiny_target(), tiny_drafter()
    prompts = random_prompts(7, [5, 9], target.config.vocab_size)
    config = GenerationConfig(max_new_tokens=12, method="ddtree", budget=6, impl="ref")
    generate(target, drafter, prompts, config)
    assert calls and all(calls)
