"""Adapters that run peers' real DDTree builders from a local checkout (never vendored here).

`load_official(path)` imports `ddtree.py` from a checkout of liranringel/ddtree. That module imports
its own training and serving stack (loguru, the DFlash model, transformers); only `build_ddtree_tree`
is needed, so those imports are satisfied by small stand-ins.
`load_sglang(path)` imports SGLang's `python/sglang/srt/speculative/ddtree_utils.py` from a checkout
(or a folder holding that file) and calls its `build_ddtree_tree(draft_logits [B, L, V], budget,
device)` once per batch, its own call convention (padded [B, budget] tokens and depths, [B, budget + 1]
parents on `device`).
With stable_topk=True the peer's `torch.topk` is pinned to the same tie order as ours (smaller id
first): torch leaves the order of tied values unspecified, and bf16 logits tie often.
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


def _exec_file(source: Path, name: str, stubs: dict, stable_topk: bool) -> types.ModuleType:
    """Runs a peer's module file under `name`, with `stubs` standing in for its heavy imports."""
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise ValueError(f"path: {source} needs a module this adapter does not provide: {exc}") from exc
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
    if stable_topk:
        module.torch = _TorchWithStableTopk()
    return module


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
    module = _exec_file(source, "_official_ddtree", stubs, stable_topk)

    def build(draft_logits: torch.Tensor, budget: int):
        t0 = time.perf_counter()
        tokens, depths, parents, _maps, _vis, _times = module.build_ddtree_tree(draft_logits, budget)
        return tokens, depths, parents, time.perf_counter() - t0

    return build


SGLANG_FILE = Path("python/sglang/srt/speculative/ddtree_utils.py")


def load_sglang(path: str | Path, *, stable_topk: bool = True) -> Callable:
    """Returns build(draft_logits [B, L, V] tensor, budget) -> [(tokens, depths, parents)] per request
    (host tensors / lists, the padding cut off). `path`: an SGLang checkout, or a folder holding
    `ddtree_utils.py`. stable_topk as in load_official."""
    root = Path(path)
    source = next((f for f in (root / SGLANG_FILE, root / SGLANG_FILE.name) if f.is_file()), None)
    if source is None:
        raise ValueError(f"path: neither {SGLANG_FILE} nor {SGLANG_FILE.name} under {path} (an SGLang "
                         "checkout with the DDTree builder is expected)")  # fmt: skip
    module = _exec_file(source, "_sglang_ddtree_utils", {}, stable_topk)
    if not callable(getattr(module, "build_ddtree_tree", None)):
        raise ValueError(f"path: {source} has no build_ddtree_tree")

    def build(draft_logits: torch.Tensor, budget: int):
        tokens, depths, parents = module.build_ddtree_tree(draft_logits, budget, draft_logits.device)[:3]
        trees = []
        for r in range(draft_logits.shape[0]):
            par = parents[r].cpu()
            n = int((par[1:] >= 0).sum())  # parents past the tree are padded with -1
            trees.append((tokens[r, :n].cpu(), depths[r, :n].cpu(), par[: n + 1].tolist()))
        return trees

    return build
