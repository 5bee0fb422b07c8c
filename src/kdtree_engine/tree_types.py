"""Tree data types (DraftTree, VerifyInputs, AcceptResult) shared by the reference, the kernels and the
public ops; a module of its own so that the kernels import no public op module."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, nodes numbered in best-first pop order (root = node 0).

    tokens    [B, budget]      int64  token of node i+1, -1 where unused
    depths    [B, budget]      int64  1-based depth of node i+1, -1 where unused
    parents   [B, budget + 1]  int64  parent node index, parents[:, 0] = -1, -1 where unused
    num_nodes [B]              int64  nodes taken (root not counted)
    max_depth                  int    the depth limit L the tree was built with
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: int

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def budget(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tokens.device


@dataclass(frozen=True)
class VerifyInputs:
    """What the target's verify forward consumes, N = budget + 1 (root first).

    input_ids             [B, N]     int64  root token then node tokens; unused slots hold 0
    positions             [B, N]     int64  start + depth (root: start); unused slots hold start
    visibility            [B, N, N]  bool   visibility[b, i, j]: node i may attend to node j
                                            (ancestor-or-self; unused slots see only themselves)
    ancestor_bits         [B, N]     int64  bit j of row i == visibility[b, i, j]; None when N > 64
    retrieve_index        [B, N]     int64  b * N + i for real nodes, -1 unused (EAGLE / SGLang form)
    retrieve_next_token   [B, N]     int64  first child (smallest index), -1 none
    retrieve_next_sibling [B, N]     int64  next sibling in index order, -1 none
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    visibility: torch.Tensor
    ancestor_bits: torch.Tensor | None
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of verifying a tree.

    accepted   [B, L + 1]  int64  accepted node indices, root first, -1 padded
    accept_len [B]         int64  number of accepted nodes, root included (>= 1)
    bonus      [B]         int64  the target's token at the last accepted node
    """

    accepted: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor
