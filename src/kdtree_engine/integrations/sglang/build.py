"""`build_ddtree_tree_gpu` with the SGLang DDTree port's signature, backed by our exact builder.

The port's own GPU builder pops equal scores in heap-slot order; ours pops them in the official
builder's order (the lexicographically smaller rank path), so on ties the trees differ and ours is the
official one. Everything else is the port's contract: the same buffers, filled the same way.
"""

from __future__ import annotations

import torch

from kdtree_engine.integrations.sglang._checks import check_budget, check_covers, need
from kdtree_engine.integrations.sglang.replay import replayed
from kdtree_engine.ref import sglang_build as ref_layout
from kdtree_engine.ref import tree as ref_tree


def _check_buffer(buf, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """ValueError naming `name` unless buf is a tensor of `dtype` on `device` covering `shape`."""
    need(isinstance(buf, torch.Tensor), name, f"expected a tensor, got {type(buf).__name__}")
    need(buf.dtype == dtype, name, f"expected dtype {dtype}, got {buf.dtype}")
    need(buf.device == device, name, f"on {buf.device}, draft_top_log_probs on {device}")
    need(buf.dim() == len(shape), name, f"expected {len(shape)} dims, got shape {tuple(buf.shape)}")
    check_covers(buf, name, shape)
    need(buf.dim() < 2 or buf.stride(-1) == 1 or buf.dtype == torch.bool, name, "expected unit column stride")


def _check_topk(lp, ids, tree_budget) -> tuple[int, int, int]:
    need(
        isinstance(lp, torch.Tensor) and lp.dim() == 3,
        "draft_top_log_probs",
        "expected a [bs, L, topk] tensor",
    )
    need(lp.is_floating_point(), "draft_top_log_probs", f"expected a float tensor, got {lp.dtype}")
    need(
        isinstance(ids, torch.Tensor) and ids.shape == lp.shape,
        "draft_top_token_ids",
        f"expected shape {tuple(lp.shape)}, got {tuple(getattr(ids, 'shape', ()))}",
    )
    need(
        not ids.is_floating_point() and ids.dtype != torch.bool,
        "draft_top_token_ids",
        "expected an integer tensor",
    )
    need(
        ids.device == lp.device, "draft_top_token_ids", f"on {ids.device}, draft_top_log_probs on {lp.device}"
    )
    check_budget(tree_budget)
    bs, depth, k = lp.shape
    need(k >= 1, "draft_top_log_probs", "topk (last dim) must be >= 1")
    return bs, depth, k


def _prune(bs: int, tree_budget: int, outs: dict, pruned: dict, scratch: torch.Tensor):
    """The port's own deepest-chain pruning kernel on our tree (it exists only inside SGLang)."""
    try:
        from sglang.kernels.ops.speculative.ddtree import prune_ddtree_deepest_chains_triton
    except ImportError as exc:
        raise ValueError(
            "prune_to_deepest_chains: runs SGLang's prune kernel (sglang.kernels.ops.speculative.ddtree."
            f"prune_ddtree_deepest_chains_triton), which does not import here: {exc}"
        ) from exc
    missing = [k for k, v in pruned.items() if v is None]
    need(not missing, "prune_to_deepest_chains", f"needs the pruned output buffers, missing {missing}")
    n = tree_budget + 1
    sizes = prune_ddtree_deepest_chains_triton(
        in_node_token_ids=outs["tokens"][:bs, :tree_budget],
        in_node_depths=outs["depths"][:bs, :tree_budget],
        in_parents=outs["parents"][:bs, :n],
        in_visibility=outs["visibility"][:bs, :n, :n],
        out_node_token_ids=pruned["tokens"][:bs, :tree_budget],
        out_node_depths=pruned["depths"][:bs, :tree_budget],
        out_parents=pruned["parents"][:bs, :n],
        out_visibility=pruned["visibility"][:bs, :n, :n],
        out_actual_tree_sizes=outs["sizes"][:bs],
        scratch=scratch[:bs],
        tree_budget=tree_budget,
    )
    sizes_cpu = [int(x) for x in sizes.detach().cpu().tolist()]  # the port's contract: a host list
    return (
        pruned["tokens"][:bs, :tree_budget],
        pruned["depths"][:bs, :tree_budget],
        pruned["parents"][:bs, :n],
        [],
        pruned["visibility"][:bs, :n, :n],
        sizes,
        sizes_cpu,
    )


def build_with_kernels(lp: torch.Tensor, ids: torch.Tensor, tree_budget: int, outs: dict) -> None:
    """The Triton path of _build (CUDA, or the CPU under the Triton interpreter as the tests run it):
    the builder writes tokens, depths, parents and sizes, then one launch writes the visibility."""
    from kdtree_engine.kernels.tree_build import build_into
    from kdtree_engine.kernels.tree_visibility import write_visibility

    bs, n = lp.shape[0], tree_budget + 1
    build_into(lp, ids, tree_budget, outs["tokens"], outs["depths"], outs["parents"], outs["sizes"],
               pad=0, count_root=True)  # fmt: skip
    write_visibility(outs["parents"], outs["sizes"], outs["visibility"][:bs, :n, :n], lp.shape[1])


def _build(lp: torch.Tensor, ids: torch.Tensor, tree_budget: int, outs: dict) -> None:
    """Our builder into the port's buffers: the Triton kernels on CUDA, the reference elsewhere."""
    lp, ids = lp.float().contiguous(), ids.long().contiguous()
    if lp.is_cuda:
        build_with_kernels(lp, ids, tree_budget, outs)
        return
    tree = ref_tree.build_tree(lp, ids, tree_budget)
    ref_layout.write_port_layout(tree, outs["tokens"], outs["depths"], outs["parents"], outs["visibility"],
                                 outs["sizes"])  # fmt: skip


@replayed(device_arg="draft_top_log_probs", bypass=lambda args, kw: kw.get("prune_to_deepest_chains", False))
def build_ddtree_tree_gpu(
    *,
    draft_top_log_probs: torch.Tensor,
    draft_top_token_ids: torch.Tensor,
    tree_budget: int,
    device: torch.device,
    _out_node_token_ids: torch.Tensor,
    _out_node_depths: torch.Tensor,
    _out_parents: torch.Tensor,
    _out_visibility: torch.Tensor,
    _out_actual_tree_sizes: torch.Tensor,
    _heap_scores: torch.Tensor,
    _heap_parents: torch.Tensor,
    _heap_depths: torch.Tensor,
    _heap_ranks: torch.Tensor,
    prune_to_deepest_chains: bool = False,
    _out_pruned_node_token_ids: torch.Tensor | None = None,
    _out_pruned_node_depths: torch.Tensor | None = None,
    _out_pruned_parents: torch.Tensor | None = None,
    _out_pruned_visibility: torch.Tensor | None = None,
):
    """The best-first DDTree of every request, exactly as the official builder, in the port's buffers.

    draft_top_log_probs / draft_top_token_ids [bs, L, topk] (sorted log-probs, global ids). Writes rows
    [:bs] of the `_out_*` buffers (see ref/sglang_build.py for the layout) and returns, as the port:
    (node_token_ids [bs, budget], node_depths [bs, budget], parents [bs, budget + 1], [] (child maps,
    built later by the caller), visibility [bs, budget + 1, budget + 1], actual_tree_sizes [bs] on the
    device, [budget + 1] * bs on the host). On CUDA: two launches (build, visibility), no host sync.
    A -inf log-prob is a masked token that never enters the tree, so actual_tree_sizes may be smaller
    than budget + 1 (the port's builder would pop garbage); the host list assumes full trees, as the
    port's does. The `_heap_*` scratch buffers are unused (our frontier lives in registers); `device` is
    accepted for the port's signature. With prune_to_deepest_chains the port's own prune kernel runs on
    our tree (CUDA with SGLang installed only) and, as in the port, the sizes are read to the host.
    """
    bs, _, _ = _check_topk(draft_top_log_probs, draft_top_token_ids, tree_budget)
    dev, n = draft_top_log_probs.device, tree_budget + 1
    i64 = torch.int64
    outs = {"tokens": _out_node_token_ids, "depths": _out_node_depths, "parents": _out_parents,
            "visibility": _out_visibility, "sizes": _out_actual_tree_sizes}  # fmt: skip
    shapes = {"tokens": (bs, tree_budget), "depths": (bs, tree_budget), "parents": (bs, n),
              "visibility": (bs, n, n), "sizes": (bs,)}  # fmt: skip
    names = {"tokens": "_out_node_token_ids", "depths": "_out_node_depths", "parents": "_out_parents",
             "visibility": "_out_visibility", "sizes": "_out_actual_tree_sizes"}  # fmt: skip
    for key, buf in outs.items():
        _check_buffer(buf, names[key], shapes[key], torch.bool if key == "visibility" else i64, dev)
    _build(draft_top_log_probs, draft_top_token_ids, tree_budget, outs)
    if prune_to_deepest_chains:
        pruned = {"tokens": _out_pruned_node_token_ids, "depths": _out_pruned_node_depths,
                  "parents": _out_pruned_parents, "visibility": _out_pruned_visibility}  # fmt: skip
        return _prune(bs, tree_budget, outs, pruned, _heap_depths)
    return (
        _out_node_token_ids[:bs, :tree_budget],
        _out_node_depths[:bs, :tree_budget],
        _out_parents[:bs, :n],
        [],
        _out_visibility[:bs, :n, :n],
        _out_actual_tree_sizes[:bs],
        [n] * bs,
    )
