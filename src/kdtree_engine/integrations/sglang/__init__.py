"""Our tree path behind the SGLang DDTree port's own function signatures (Rancy-Wang/sglang, branch
ddtree-v2, `python/sglang/srt/speculative/ddtree_utils.py`), so that SGLang runs our kernels unchanged.

Each function takes exactly the port's arguments and returns exactly its outputs, writing into the
caller's preallocated buffers; on CUDA it runs our Triton kernels (no host synchronisation where the
port's contract allows none), elsewhere the torch references. `install()` swaps them into a running
SGLang and registers our MLA attention backend, `kdtree_mla` (see
kdtree_engine.integrations.sglang.plugin, .attention and docs/sglang.md).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_ddtree_tree_gpu": "build",
    "compile_ddtree_tree": "verify",
    "follow_verified_tree_gpu": "verify",
    "sample_ddtree_target_probs_gpu": "sample",
    "compute_draft_topk_log_probs_and_token_ids": "topk",
    "draft_topk": "topk",
    "install": "plugin",
    "TreeMLABackend": "attention",
    "BackendConfig": "attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Imports each piece on first use: the plug-in entry point must load without triton or SGLang."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
