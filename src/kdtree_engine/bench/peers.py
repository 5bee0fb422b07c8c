"""Adapters that run peers' real DDTree builders from a local checkout (never vendored here).

`load_official(path)` imports `ddtree.py` from a checkout of liranringel/ddtree. That module imports
its own training and serving stack (loguru, the DFlash model, transformers); only `build_ddtree_tree`
is needed, so those imports are satisfied by small stand-ins.
`load_sglang(path)` imports SGLang's `python/sglang/srt/speculative/ddtree_utils.py` from a checkout
(or a folder holding that file) and calls its `build_ddtree_tree(draft_logits [B, L, V], budget,
device)` once per batch, its own call convention (padded [B, budget] tokens and depths, [B, budget + 1]
parents on `device`).
`load_sglang_triton(path)` imports the SGLang DDTree port's Triton module
(`python/sglang/kernels/ops/speculative/ddtree.py`, Rancy-Wang/sglang branch ddtree-v2; it imports only
torch and triton) and runs its GPU path from draft logits to the verify inputs (SglangTriton).
`scripts/fetch_peers.sh` extracts both SGLang files into `.peers/sglang`.
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


SGLANG_TRITON_FILE = Path("python/sglang/kernels/ops/speculative/ddtree.py")


def load_sglang_triton(path: str | Path) -> Callable:
    """Returns make(batch, depth, budget, device) -> SglangTriton, from `path`: a checkout of the SGLang
    DDTree port (or `.peers/sglang` as scripts/fetch_peers.sh writes it)."""
    source = Path(path) / SGLANG_TRITON_FILE
    if not source.is_file():
        raise ValueError(f"path: no {SGLANG_TRITON_FILE} under {path} (scripts/fetch_peers.sh puts the "
                         "SGLang DDTree port there)")  # fmt: skip
    module = _exec_file(source, "_sglang_ddtree_triton", {}, stable_topk=False)
    for fn in ("build_ddtree_tree_triton", "compile_ddtree_tree_triton"):
        if not callable(getattr(module, fn, None)):
            raise ValueError(f"path: {source} has no {fn}")
    return lambda batch, depth, budget, device: SglangTriton(module, batch, depth, budget, device)


class SglangTriton:
    """The SGLang DDTree port's GPU path for one (batch B, depth L, budget) on CUDA, with its buffers
    allocated once, as its worker allocates them.

    topk(logits [B, L, V]): its worker's draft top-k on one tensor-parallel rank: float32 logits,
      log Z = max + log(sum(exp(x - max))), torch.topk with k = min(budget, V), values - log Z (the
      worker's id map and padding copies are left out).
    build(lp, ids): build_ddtree_tree_triton(lp, ids [B, L, k]), one program per request: exactly
      `budget` best-first pops (float64 scores updated as ours), writing `tokens`, `depths` [B, budget],
      `parents` [B, budget + 1] and the ancestor-or-self `visibility` [B, budget + 1, budget + 1].
      Nodes are numbered in pop order, as ours; equal scores pop the candidate pushed first (heap slot
      2i+1 for pop i's next sibling, 2i+2 for its first child), not the official lexicographic order.
    verify(roots, starts [B]): compile_ddtree_tree_triton without its packed attention mask (the path
      of its FlashAttention backend, which reads `visibility`): `input_ids`, `positions` [B, budget + 1].
    """

    def __init__(self, module, batch: int, depth: int, budget: int, device):
        self.module, self.budget = module, budget
        self.buffers = port_tree_buffers(batch, budget, device)
        self.tokens, self.depths = self.buffers["_out_node_token_ids"], self.buffers["_out_node_depths"]
        self.parents, self.visibility = self.buffers["_out_parents"], self.buffers["_out_visibility"]
        self.sizes = self.buffers["_out_actual_tree_sizes"]
        n, i64 = budget + 1, {"dtype": torch.int64, "device": device}
        self.input_ids, self.positions = torch.empty(batch, n, **i64), torch.empty(batch, n, **i64)

    def topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ids = _port_worker_topk(logits.reshape(-1, logits.shape[-1]), min(self.budget, logits.shape[-1]))
        shape = (*logits.shape[:2], -1)
        return lp.view(shape), ids.view(shape)

    def build(self, lp: torch.Tensor, ids: torch.Tensor) -> None:
        self.module.build_ddtree_tree_triton(
            top_log_probs=lp, top_token_ids=ids, tree_budget=self.budget,
            **{name.lstrip("_"): buf for name, buf in self.buffers.items()},  # out_node_token_ids=, ...
        )  # fmt: skip

    def verify(self, roots: torch.Tensor, starts: torch.Tensor) -> None:
        self.module.compile_ddtree_tree_triton(
            root_token_ids=roots, node_token_ids=self.tokens, node_depths=self.depths,
            visibility=self.visibility, start_positions=starts, past_lengths=starts,
            actual_tree_sizes=self.sizes, verify_input_ids=self.input_ids,
            verify_position_ids=self.positions, tree_attention_mask=None, q_len=self.budget + 1,
        )  # fmt: skip

    def from_topk(self, lp, ids, roots, starts) -> None:
        self.build(lp, ids)
        self.verify(roots, starts)

    def from_logits(self, logits, roots, starts) -> None:
        self.from_topk(*self.topk(logits), roots, starts)


def port_tree_buffers(batch: int, budget: int, device="cpu") -> dict:
    """The tree buffers of the SGLang port's worker for `batch` requests, allocated as it allocates them
    (zeros, parents -1, empty heap scratch of next_pow2(2 budget + 4) slots), keyed by the names of
    build_ddtree_tree_gpu's arguments."""
    n, heap = budget + 1, 1 << (2 * budget + 3).bit_length()
    i64 = {"dtype": torch.int64, "device": device}
    i32 = {"dtype": torch.int32, "device": device}
    return {
        "_out_node_token_ids": torch.zeros(batch, budget, **i64),
        "_out_node_depths": torch.zeros(batch, budget, **i64),
        "_out_parents": torch.full((batch, n), -1, **i64),
        "_out_visibility": torch.zeros(batch, n, n, dtype=torch.bool, device=device),
        "_out_actual_tree_sizes": torch.zeros(batch, **i64),
        "_heap_scores": torch.empty(batch, heap, dtype=torch.float64, device=device),
        "_heap_parents": torch.empty(batch, heap, **i32),
        "_heap_depths": torch.empty(batch, heap, **i32),
        "_heap_ranks": torch.empty(batch, heap, **i32),
    }


def token_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """A tree (node i+1: tokens[i], parents[i + 1]; parents numbered before children) as the set of its
    nodes' root-to-node token paths: free of the node numbering, it fixes the token set, the parents and
    the depths (siblings carry distinct top-k ids)."""
    paths = [()]
    for i, token in enumerate(tokens, 1):
        paths.append(paths[parents[i]] + (token,))
    return set(paths[1:])


PORT_KERNELS = "sglang.kernels.ops.speculative.ddtree"


def load_sglang_port(path: str | Path) -> types.SimpleNamespace:
    """The SGLang DDTree port's tree path as its worker calls it: `utils` (its ddtree_utils.py, whose
    GPU functions import their Triton kernels from `sglang.kernels.ops.speculative.ddtree`) and `kernels`
    (that module, from the checkout, registered under its own name for them, with empty parent
    packages where no SGLang is installed) and `topk(logits [T, V], k)`: its worker's draft top-k on one
    rank (float32 logits, log Z = max + log(sum(exp(x - max))), torch.topk)."""
    root = Path(path)
    for f in (SGLANG_FILE, SGLANG_TRITON_FILE):
        if not (root / f).is_file():
            raise ValueError(
                f"path: no {f} under {path} (scripts/fetch_peers.sh puts the SGLang DDTree port there)"
            )
    kernels = _exec_file(root / SGLANG_TRITON_FILE, PORT_KERNELS, {}, stable_topk=False)
    parts = PORT_KERNELS.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), _stub_module(".".join(parts[:i])))
    sys.modules[PORT_KERNELS] = kernels
    utils = _exec_file(root / SGLANG_FILE, "_sglang_port_ddtree_utils", {}, stable_topk=False)
    return types.SimpleNamespace(utils=utils, kernels=kernels, topk=_port_worker_topk)


def _port_worker_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    m = x.amax(dim=-1)
    log_z = m + torch.log(torch.exp(x - m[:, None]).sum(dim=-1).clamp_min(1e-38))
    values, ids = torch.topk(x, k, dim=-1)
    return values - log_z[:, None], ids
