"""Our engine against the official DDTree / DFlash loops (liranringel/ddtree: ddtree_generate and
dflash_generate) run from a local checkout: the same tiny random target (transformers'
DeepseekV3ForCausalLM for them, ours with identical weights for us, float64) and the same random DFlash
drafter (the official DFlashDraftModel with our tensors). Greedy: the outputs AND the accepted length of
every round must be equal, i.e. the same trees were built and verified.

Skipped unless KDTREE_OFFICIAL_DDTREE points at a checkout. The checkout imports loguru and datasets
(stand-ins replace them), times with torch.cuda.synchronize (replaced by perf_counter on the CPU) and was
written for transformers 4 (`DynamicCache.crop(n)` with n > 0 meant "keep n"; restored here).

    KDTREE_OFFICIAL_DDTREE=/path/to/ddtree python -m pytest tests/engine/test_official.py
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import types

import pytest
import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.engine import GenerationConfig, generate

OFFICIAL = os.environ.get("KDTREE_OFFICIAL_DDTREE")
pytestmark = pytest.mark.skipif(not OFFICIAL, reason="set KDTREE_OFFICIAL_DDTREE to a ddtree checkout")


def _import_official():
    stubs = {
        "loguru": types.SimpleNamespace(logger=types.SimpleNamespace(info=print, warning=print)),
        "datasets": types.SimpleNamespace(load_dataset=None, Features=None, Sequence=None, Value=None),
    }
    names = ("model", "model.dflash", "model.utils", "dflash", "ddtree")
    saved = {k: sys.modules.get(k) for k in (*stubs, *names)}
    sys.modules.update(stubs)
    sys.path.insert(0, OFFICIAL)
    try:
        mods = {n: importlib.import_module(n) for n in ("model", "dflash", "ddtree")}
    finally:
        sys.path.remove(OFFICIAL)
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
    for m in (mods["dflash"], mods["ddtree"]):
        m.cuda_time = time.perf_counter
    return mods


@pytest.fixture
def legacy_crop(monkeypatch):
    from transformers import DynamicCache

    crop = DynamicCache.crop

    def keep(self, max_length: int):
        return crop(self, max_length - self.get_seq_length()) if max_length >= 0 else crop(self, max_length)

    monkeypatch.setattr(DynamicCache, "crop", keep)


def _official_drafter(mods, ours):
    from transformers import Qwen3Config

    hf_cfg = Qwen3Config(**{k: v for k, v in ours.config.to_hf_dict().items() if k != "architectures"})
    hf_cfg._attn_implementation = "eager"
    model = mods["model"].DFlashDraftModel(hf_cfg).double().eval()
    model.load_state_dict(ours.state_dict(), strict=False)
    return model


@pytest.mark.parametrize("budget", [4, 32])
def test_engine_equals_official_ddtree_and_dflash(legacy_crop, budget, tmp_path):
    from tests.engine.helpers import hf_twin

    mods = _import_official()
    hf, target = hf_twin(tmp_path, torch.float64)
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=8), seed=3, dtype=torch.float64)
    official = _official_drafter(mods, drafter)
    prompt, n, mask = [5, 17, 3, 99, 42, 7], 24, drafter.config.mask_token_id
    ids = torch.tensor([prompt])
    theirs = mods["ddtree"].ddtree_generate(official, hf, ids, mask, n, drafter.block_size, None, 0.0, budget)
    config = GenerationConfig(max_new_tokens=n, method="ddtree", budget=budget)
    ours = generate(target, drafter, [prompt], config)
    assert ours.tokens[0] == theirs.output_ids[0, len(prompt) :].tolist()
    rounds = len(ours.stats.accept_lengths)
    assert ours.stats.accept_lengths == theirs.acceptance_lengths[:rounds]

    chain = mods["dflash"].dflash_generate(official, hf, ids, mask, n, drafter.block_size, None, 0.0)
    ours = generate(target, drafter, [prompt], GenerationConfig(max_new_tokens=n, method="dflash"))
    assert ours.tokens[0] == chain.output_ids[0, len(prompt) :].tolist()
    assert ours.stats.accept_lengths == chain.acceptance_lengths[: len(ours.stats.accept_lengths)]
