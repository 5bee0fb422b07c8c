"""Our DFlash drafter against the official `DFlashDraftModel` (liranringel/ddtree, model/dflash.py), run
from a local checkout: same config, same tensors (loaded by name, so the checkpoint names are checked
too), several drafting rounds with the official DynamicCache + crop(start) protocol.

Skipped unless KDTREE_OFFICIAL_DDTREE points at a checkout (its model/utils.py imports `datasets`, which
a stand-in replaces; nothing of it is vendored here):

    KDTREE_OFFICIAL_DDTREE=/path/to/ddtree python -m pytest tests/drafter/test_official.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from kdtree_engine.drafter import DFlashConfig, build_target_layer_ids, random_drafter

OFFICIAL = os.environ.get("KDTREE_OFFICIAL_DDTREE")
pytestmark = pytest.mark.skipif(not OFFICIAL, reason="set KDTREE_OFFICIAL_DDTREE to a ddtree checkout")

CFG = DFlashConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    block_size=6,
    target_layer_ids=(0, 2, 3),
    mask_token_id=63,
    num_target_layers=4,
    rope_theta=10_000.0,
)


def _load_official_class():
    pkg, source = "_official_ddtree_model", Path(OFFICIAL) / "model" / "dflash.py"
    utils = types.ModuleType(f"{pkg}.utils")
    utils.build_target_layer_ids = build_target_layer_ids
    utils.extract_context_feature = utils.sample = None
    package = types.ModuleType(pkg)
    package.__path__ = []
    sys.modules[pkg], sys.modules[f"{pkg}.utils"] = package, utils
    spec = importlib.util.spec_from_file_location(f"{pkg}.dflash", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DFlashDraftModel


def _official(drafter):
    from transformers import Qwen3Config

    hf = Qwen3Config(**{k: v for k, v in CFG.to_hf_dict().items() if k != "architectures"})
    hf._attn_implementation = "eager"
    model = _load_official_class()(hf).float().eval()
    missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    assert model.target_layer_ids == list(CFG.target_layer_ids) and model.block_size == CFG.block_size
    return model


def test_drafter_equals_official_dflash_over_rounds():
    from transformers import DynamicCache

    drafter = random_drafter(CFG, seed=11)
    official = _official(drafter)
    gen = torch.Generator().manual_seed(0)
    f, t = len(CFG.target_layer_ids) * CFG.hidden_size, CFG.block_size
    cache, past, start = drafter.new_cache(1, 64), DynamicCache(), 0
    for new_rows in (7, 3, 1, 5):  # prompt, then accepted rows of each round
        ctx = torch.randn(1, new_rows, f, generator=gen)
        block = torch.randn(1, t, CFG.hidden_size, generator=gen)
        start += new_rows
        ours = drafter(block, ctx, torch.tensor([new_rows]), torch.tensor([start]), cache)
        with torch.no_grad():
            theirs = official(
                target_hidden=ctx,
                noise_embedding=block,
                position_ids=torch.arange(past.get_seq_length(), start + t)[None],
                past_key_values=past,
                use_cache=True,
                is_causal=False,
            )
        past.crop(start - past.get_seq_length())  # keep the context rows (transformers 5: negative)
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)
