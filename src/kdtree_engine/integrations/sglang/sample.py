"""`sample_ddtree_target_probs_gpu` with the SGLang DDTree port's signature: the sampled (non-greedy)
verify of a tree, backed by our exact fixed-point sampler (ref/sglang_sample.py states the rule).

Like the port, it first fills uniform_samples[:bs, :q] and uniform_final[:bs] from torch's generator
(the same draws in the same order, so both consume the same uniforms), then walks each request's tree
and draws the next token from the reject node's residual. On CUDA: three Triton launches, no host
synchronisation; elsewhere the torch reference, written into the same buffers.
"""

from __future__ import annotations

import torch

from kdtree_engine.integrations.sglang._checks import check_covers, need
from kdtree_engine.integrations.sglang.replay import replayed
from kdtree_engine.ref import sglang_sample as ref

_INTS = (torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(x, name: str, dims: int, dtypes: tuple, device: torch.device, unit_stride: bool = True) -> None:
    """ValueError naming `name` unless x is a `dims`-D tensor of one of `dtypes` on `device` (and, with
    unit_stride, of a unit column stride when it has rows)."""
    need(isinstance(x, torch.Tensor), name, f"expected a tensor, got {type(x).__name__}")
    need(x.dim() == dims, name, f"expected {dims} dimensions, got shape {tuple(x.shape)}")
    need(x.dtype in dtypes, name, f"expected dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    need(x.device == device, name, f"on {x.device}, target_probs on {device}")
    unit = dims < 2 or not unit_stride or x.shape[-1] <= 1 or x.stride(-1) == 1
    need(unit, name, "expected a unit column stride")


def _validate(target_probs, draft_tokens, parents, actual_tree_sizes, buffers: dict) -> tuple[int, int]:
    """Shapes, dtypes and devices of every argument (no values are read) -> (bs, q)."""
    need(isinstance(target_probs, torch.Tensor), "target_probs", "expected a tensor")
    shape = tuple(target_probs.shape)
    need(target_probs.dim() == 3, "target_probs", f"expected [bs, q, vocab], got {shape}")
    dev = target_probs.device
    _check(target_probs, "target_probs", 3, _FLOATS, dev, unit_stride=False)  # made contiguous if needed
    bs, q, vocab = target_probs.shape
    need(q >= 1, "target_probs", f"q (dim 1) must be positive, got {q}")
    need(1 <= vocab <= ref.MAX_VOCAB, "target_probs", f"vocab (dim 2) must be in [1, 2^22], got {vocab}")
    for name, x in (("draft_tokens", draft_tokens), ("parents", parents)):
        _check(x, name, 2, _INTS, dev)
        need(x.shape == (bs, q), name, f"expected shape {(bs, q)}, got {tuple(x.shape)}")
    if actual_tree_sizes is not None:
        _check(actual_tree_sizes, "actual_tree_sizes", 1, _INTS, dev)
        check_covers(actual_tree_sizes, "actual_tree_sizes", (bs,))
    for name, x in buffers.items():
        rows = name in ("uniform_samples", "accepted_indices", "accepted_token_ids", "reject_child_tokens")
        dtypes = (torch.float32,) if name.startswith("uniform") else (torch.int64,)
        _check(x, name, 2 if rows else 1, dtypes, dev)
        check_covers(x, name, (bs, q) if rows else (bs,))
    return bs, q


@replayed(device_arg="target_probs")
def sample_ddtree_target_probs_gpu(
    *,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    actual_tree_sizes: torch.Tensor | None = None,
    uniform_samples: torch.Tensor,
    uniform_final: torch.Tensor,
    accepted_indices: torch.Tensor,
    accepted_token_ids: torch.Tensor,
    accepted_lens: torch.Tensor,
    next_tokens: torch.Tensor,
    reject_indices: torch.Tensor,
    reject_child_tokens: torch.Tensor,
    reject_child_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target-only sampled verify of a batch of trees in the verify layout.

    target_probs [bs, q, V] float (the target's distribution after each slot; float32, bfloat16, float16
    or float64, V <= 2^22), draft_tokens / parents [bs, q] int64 or int32, actual_tree_sizes [>= bs]
    (real slots with the root; None: q). Buffers (rows [:bs], columns [:q] are used, the rest is left
    untouched): uniform_samples [>= bs, >= q] and uniform_final [>= bs] float32, refilled here with
    uniform_(); out: accepted_indices, accepted_token_ids, reject_child_tokens [>= bs, >= q] and
    accepted_lens, next_tokens, reject_indices, reject_child_counts [>= bs], int64.

    Returns (accepted_indices[:bs, :q], accepted_token_ids[:bs, :q], accepted_lens[:bs],
    next_tokens[:bs]), as the port. The rule is the port's, in exact fixed point (ref/sglang_sample.py):
    at node c the walk takes the first child whose running probability sum exceeds uniform_samples[b, c],
    else it rejects at c and draws the next token from c's target row with c's child tokens masked,
    using uniform_final[b]. Probabilities under 2^-40 count as 0. Differences from the port, all on
    inputs where the port's result is an artefact: reject_child_tokens holds the reject node's child
    tokens at the front and zeros after (the port leaves the child tokens of earlier path nodes behind
    its count); with no residual mass the next token is the non-child token of largest probability (the
    port's search returns token 0, possibly a child token); buffers whose row stride exceeds q are
    written by their strides (the port's kernel assumes a row stride of q); a token id outside [0, V)
    has probability 0 (the port reads out of bounds). Bad shapes, dtypes or devices raise ValueError
    naming the argument; no tensor value is read on the host.
    """
    buffers = dict(
        uniform_samples=uniform_samples, uniform_final=uniform_final, accepted_indices=accepted_indices,
        accepted_token_ids=accepted_token_ids, accepted_lens=accepted_lens, next_tokens=next_tokens,
        reject_indices=reject_indices, reject_child_tokens=reject_child_tokens,
        reject_child_counts=reject_child_counts,
    )  # fmt: skip
    bs, q = _validate(target_probs, draft_tokens, parents, actual_tree_sizes, buffers)
    views = {k: (v[:bs, :q] if v.dim() == 2 else v[:bs]) for k, v in buffers.items()}
    sizes = None if actual_tree_sizes is None else actual_tree_sizes[:bs]
    views["uniform_samples"].uniform_()
    views["uniform_final"].uniform_()
    if bs and target_probs.is_cuda:
        from kdtree_engine.kernels.sglang_sample import sample_into

        sample_into(target_probs, draft_tokens, parents, sizes, **views)
    elif bs:
        if sizes is None:
            sizes = torch.full((bs,), q, dtype=torch.int64)
        result = ref.sample_path(
            target_probs, draft_tokens, parents, sizes, views["uniform_samples"], views["uniform_final"]
        )
        for name, value in result._asdict().items():
            views[name].copy_(value)
    return tuple(views[k] for k in ("accepted_indices", "accepted_token_ids", "accepted_lens", "next_tokens"))
