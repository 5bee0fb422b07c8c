"""The greedy accepted path of DDTree trees in the SGLang port's layout, on the GPU (twin of
ref.sglang_verify.follow_verified_path): the shared greedy walk of kernels/tree_accept.py with the
port's rules (the root's token in column 0, the lowest-numbered matching child)."""

from __future__ import annotations

import torch

from kdtree_engine.kernels.tree_accept import walk


def follow_path(
    draft_tokens: torch.Tensor,
    target_predict: torch.Tensor,
    parents: torch.Tensor,
    sizes: torch.Tensor,
    indices_out: torch.Tensor,
    tokens_out: torch.Tensor,
    lengths_out: torch.Tensor,
    next_out: torch.Tensor,
) -> None:
    """draft_tokens / target_predict / parents [B, q] (any strides), sizes [>= B] -> writes rows [:B],
    columns [:q] of indices_out / tokens_out and entries [:B] of lengths_out / next_out (any strides).
    Inputs are validated by the caller."""
    walk(draft_tokens, target_predict, parents, sizes, indices_out, lengths_out, next_out,
         width=draft_tokens.shape[1], root_token=True, size_plus=0, largest=False,
         tokens_out=tokens_out)  # fmt: skip
