"""Public tree ops: build, compile, accept. Each validates its inputs, then dispatches to ref/ or kernels/."""

from __future__ import annotations

import torch

from kdtree_engine.impl import resolve_impl
from kdtree_engine.ref import tree as ref
from kdtree_engine.tree import validate as v
from kdtree_engine.tree.types import AcceptResult, DraftTree, VerifyInputs


def _kernels():
    from kdtree_engine.kernels import tree as kernels  # imported lazily: triton is optional

    return kernels


def build_tree(
    top_logprobs,
    top_ids,
    budget: int,
    *,
    vocab_size: int | None = None,
    impl: str | None = None,
    validate: bool = True,
) -> DraftTree:
    """Best-first DDTree build from per-position top-k, exactly as the official builder.

    top_logprobs [B, L, K] float32 log-softmax values, rows sorted descending ([L, K] is taken as B=1);
    top_ids [B, L, K] int64 token ids; budget >= 0 nodes, root not counted. Only the first
    min(budget, K) columns are used. vocab_size, when given, bounds the ids.
    Returns a DraftTree with tokens/depths [B, budget], parents [B, budget + 1], num_nodes [B].
    """
    budget = v.check_int(budget, "budget")
    lp, ids = v.check_topk_inputs(top_logprobs, top_ids, vocab_size, validate)
    if resolve_impl(impl, lp.device) == "triton":
        return _kernels().build_tree(lp, ids, budget)
    return ref.build_tree(lp, ids, budget)


def build_tree_from_logits(
    draft_logits, budget: int, *, impl: str | None = None, validate: bool = True
) -> DraftTree:
    """draft_logits [B, L, V] (any float dtype; [L, V] is taken as B=1): float32 log-softmax, top-k with
    k = min(budget, V) (ties: smaller token id first), then build_tree."""
    budget = v.check_int(budget, "budget")
    logits = v.as_tensor(draft_logits, "draft_logits")
    if logits.dim() == 2:
        logits = logits.unsqueeze(0)
    v.check_rank(logits, "draft_logits", 3, "[B, L, V]")
    if logits.shape[-1] == 0:
        raise ValueError("draft_logits: V (last dim) must be >= 1")
    v.check_float(logits, "draft_logits")
    if validate:
        v.check_finite(logits, "draft_logits")
    if resolve_impl(impl, logits.device) == "triton":
        return _kernels().build_tree_from_logits(logits, budget)
    if budget == 0:
        empty = logits.new_zeros(*logits.shape[:2], 1)
        return ref.build_tree(empty, empty.long(), 0)
    lp, ids = ref.logits_to_topk(logits, budget)
    return ref.build_tree(lp, ids, budget)


def _check_tree(tree: DraftTree) -> None:
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree: expected a DraftTree, got {type(tree).__name__}")


def _check_per_request(x, name: str, tree: DraftTree, width: int | None = None) -> torch.Tensor:
    t = v.check_integer_dtype(v.as_tensor(x, name), name)
    shape = (tree.batch_size,) if width is None else (tree.batch_size, width)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    v.check_same_device({"tree": tree.tokens, name: t})
    return t.contiguous()


def compile_tree(
    tree: DraftTree, root_tokens, start_positions, *, impl: str | None = None
) -> VerifyInputs:
    """root_tokens [B] int64 (the bonus token each tree hangs from), start_positions [B] int64 (the
    root's position) -> VerifyInputs with N = budget + 1 (see its docstring)."""
    _check_tree(tree)
    roots = _check_per_request(root_tokens, "root_tokens", tree)
    starts = _check_per_request(start_positions, "start_positions", tree)
    if starts.numel() and bool((starts < 0).any()):
        raise ValueError("start_positions: expected >= 0")
    if resolve_impl(impl, tree.device) == "triton":
        return _kernels().compile_tree(tree, roots, starts)
    return ref.compile_tree(tree, roots, starts)


def accept_greedy(tree: DraftTree, target_tokens, *, impl: str | None = None) -> AcceptResult:
    """target_tokens [B, N] int64, the target's argmax at every tree node (N = budget + 1) ->
    AcceptResult: accepted [B, L + 1] node indices (root first, -1 padded), accept_len [B], bonus [B]."""
    _check_tree(tree)
    target = _check_per_request(target_tokens, "target_tokens", tree, tree.budget + 1)
    if resolve_impl(impl, tree.device) == "triton":
        return _kernels().accept_greedy(tree, target)
    return ref.accept_greedy(tree, target)
