"""Adapters that run peers' real DDTree builders from a local checkout (never vendored here).

`load_official(path)` imports `ddtree.py` from a checkout of liranringel/ddtree. That module imports
its own training and serving stack (loguru, the DFlash model, transformers); only `build_ddtree_tree`
is needed, so those imports are satisfied by small stand-ins. Its `torch.topk` is pinned to the same
tie order as ours (smaller id first): torch leaves the order of tied values unspecified, and bf16
logits tie often.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from kdtree_engine.ref.tree import topk_stable


def _stub_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class _TorchWithStableTopk(types.ModuleType):
    """The real torch, except that topk orders ties by index."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def topk(x, k, dim=-1):
        if dim not in (-1, x.dim() - 1):
            raise ValueError("dim: only the last dim is supported")
        return topk_stable(x, k)


def load_official(path: str | Path, *, stable_topk: bool = True) -> Callable:
    """Returns build(draft_logits [L, V] tensor, budget) -> (tokens, depths, parents, seconds).

    stable_topk=True pins top-k ties to our order (to compare trees); False keeps the peer's own
    torch.topk (to time it as it runs)."""
    source = Path(path) / "ddtree.py"
    if not source.is_file():
        raise ValueError(f"path: no ddtree.py under {path} (a checkout of liranringel/ddtree is expected)")
    stubs = {
        "loguru": _stub_module("loguru", logger=_stub_module("logger", info=print, warning=print)),
        "model": _stub_module("model", DFlashDraftModel=object, sample=None, extract_context_feature=None),
        "dflash": _stub_module(
            "dflash",
            dflash_generate=None,
            cuda_time=time.perf_counter,
            empty_stage_times=lambda order: {k: 0.0 for k in order},
        ),
    }
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("_official_ddtree", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
    if stable_topk:
        module.torch = _TorchWithStableTopk()

    def build(draft_logits: torch.Tensor, budget: int):
        t0 = time.perf_counter()
        tokens, depths, parents, _maps, _vis, _times = module.build_ddtree_tree(draft_logits, budget)
        return tokens, depths, parents, time.perf_counter() - t0

    return build
