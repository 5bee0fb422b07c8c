"""What the training loop does with the pool and the objective: batches of blocks (pool rows and anchors
in their continuation), one optimizer step on a batch, and the held-out metrics of a pool with fixed
anchors.

Dimension names: B sequences, S rows per sequence, A anchors per sequence, L = block_size - 1 drafted
positions per block, F features per row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kdtree_engine.drafter import DFlashDrafter
from kdtree_engine.train.drafter_objective import (
    block_labels,
    chain_acceptance,
    dflash_loss,
    loss_weights,
    training_logits,
)
from kdtree_engine.train.drafter_pool import Pool

__all__ = [
    "Batch",
    "HeldoutMetrics",
    "anchor_range",
    "evaluate",
    "random_batch",
    "sample_anchors",
    "train_step",
]


def sample_anchors(batch: int, count: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, count] int64 anchors in [lo, hi] (CPU), distinct within a row when count <= hi - lo + 1."""
    span = hi - lo + 1
    if span < 1:
        raise ValueError(f"anchors: empty range [{lo}, {hi}]")
    if count <= span:
        return torch.rand(batch, span, generator=gen).argsort(dim=1)[:, :count] + lo
    return torch.randint(lo, hi + 1, (batch, count), generator=gen)


def anchor_range(pool: Pool, block_size: int) -> tuple[int, int]:
    """The allowed anchors: from the last prompt token to the last one with a full block of labels."""
    return pool.prompt_len - 1, pool.seq_len - block_size


@dataclass
class Batch:
    """tokens [B, S], features [B, S, F], anchors [B, A]: one training (or evaluation) batch."""

    tokens: torch.Tensor
    features: torch.Tensor
    anchors: torch.Tensor

    def labels(self, draft_len: int) -> torch.Tensor:
        return block_labels(self.tokens, self.anchors, draft_len)

    def logits(self, drafter: DFlashDrafter, target) -> torch.Tensor:
        """training_logits of this batch [B, A, L, V]."""
        return training_logits(drafter, target, self.tokens, self.features, self.anchors)


def random_batch(pool: Pool, batch: int, anchors: int, block_size: int, gen: torch.Generator) -> Batch:
    """Rows drawn with replacement, `anchors` random anchors each (indices drawn on the CPU by `gen`)."""
    rows = torch.randint(len(pool), (batch,), generator=gen)
    lo, hi = anchor_range(pool, block_size)
    anch = sample_anchors(batch, anchors, lo, hi, gen)
    dev = pool.tokens.device
    rows = rows.to(dev)
    return Batch(pool.tokens[rows], pool.features[rows], anch.to(dev))


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master parameters); plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    drafter: DFlashDrafter, target, batch: Batch, optimizer, gamma: float, grad_clip: float
) -> torch.Tensor:
    """One optimizer step on `batch`; returns the loss (a detached device scalar: no host sync)."""
    with autocast(batch.tokens.device):
        logits = batch.logits(drafter, target)
        loss = dflash_loss(logits, batch.labels(drafter.config.draft_len), gamma)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    optimizer.step()
    return loss.detach()


@dataclass(frozen=True)
class HeldoutMetrics:
    """loss: dflash_loss over the held-out blocks; acceptance: mean chain_acceptance."""

    loss: float
    acceptance: float


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter, target, pool: Pool, anchors: torch.Tensor, gamma: float, batch_size: int
) -> HeldoutMetrics:
    """The held-out metrics of every pool row with its fixed anchors [N, A], `batch_size` rows at a time:
    the cross-entropy is summed per block position over all blocks (float64) before it is weighted, so
    the loss is dflash_loss of all the blocks at once."""
    draft_len = drafter.config.draft_len
    per_pos = torch.zeros(draft_len, dtype=torch.float64, device=pool.tokens.device)
    accepted = 0.0
    for lo in range(0, len(pool), batch_size):
        rows = slice(lo, lo + batch_size)
        batch = Batch(pool.tokens[rows], pool.features[rows], anchors[rows])
        labels = batch.labels(draft_len)
        with autocast(batch.tokens.device):
            logits = batch.logits(drafter, target)
        ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        per_pos += ce.view(-1, draft_len).sum(0).double()
        accepted += float(chain_acceptance(logits, labels).sum())
    blocks = anchors.numel()
    w = loss_weights(draft_len, gamma, device=per_pos.device).double()
    loss = float((per_pos / blocks * w).sum() / w.sum())
    return HeldoutMetrics(loss=loss, acceptance=accepted / blocks)
