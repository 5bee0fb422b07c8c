"""The DFlash drafter's training objective (kdtree_engine.train.drafter_objective) on a tiny random
target, float32, CPU: the parallel training forward against the inference drafter, the block labels, the
weighted loss and the chain acceptance."""

from __future__ import annotations

import math

import pytest
import torch

from kdtree_engine.drafter import random_drafter, tiny_drafter_config
from kdtree_engine.model import random_model, tiny_config
from kdtree_engine.train.drafter_objective import (
    block_labels,
    chain_acceptance,
    dflash_loss,
    loss_weights,
    training_logits,
)
from kdtree_engine.train.drafter_pool import target_features
from kdtree_engine.train.drafter_step import sample_anchors

LAYERS = (0, 2)
VOCAB = 128


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(), seed=0).requires_grad_(False)


def _drafter(target, seed: int = 1, block_size: int = 4):
    return random_drafter(
        tiny_drafter_config(target.config, block_size=block_size, target_layer_ids=LAYERS), seed
    )


def _tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch", [1, 3])
def test_training_logits_equal_inference_draft(target, batch):
    """Block j of the parallel forward == DFlashDrafter.draft on a fresh cache with the context rows < a,
    bonus x[a] at start a; the anchors include the smallest (prompt_len - 1) and largest (S - 1 - L)."""
    drafter = _drafter(target)
    prompt_len, s, t = 4, 15, drafter.block_size
    lo, hi = prompt_len - 1, s - t
    tokens = _tokens(batch, s, seed=batch)
    features = target_features(target, tokens, LAYERS)
    gen = torch.Generator().manual_seed(batch)
    anchors = torch.cat([sample_anchors(batch, 3, lo, hi, gen), torch.tensor([[lo, hi]]).expand(batch, 2)], 1)
    anchors[0, :2] = torch.tensor([hi, lo])  # other orders in other rows
    logits = training_logits(drafter, target, tokens, features, anchors)
    assert logits.shape == (batch, 5, t - 1, VOCAB) and logits.dtype == torch.float32
    for j in range(anchors.shape[1]):
        a = anchors[:, j]
        bonus = tokens.gather(1, a[:, None])[:, 0]
        context = features[:, : int(a.max())]
        want = drafter.draft(target, context, a, bonus, a, drafter.new_cache(batch, s + t))
        torch.testing.assert_close(logits[:, j], want, rtol=1e-5, atol=1e-5)


def test_training_gradients_reach_every_drafter_parameter(target):
    drafter = _drafter(target).train()
    tokens = _tokens(2, 12)
    features = target_features(target, tokens, LAYERS)
    anchors = torch.tensor([[3, 8], [5, 4]])
    loss = dflash_loss(
        training_logits(drafter, target, tokens, features, anchors), block_labels(tokens, anchors, 3), 7.0
    )
    loss.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_block_labels_are_the_tokens_after_the_anchor():
    tokens = torch.arange(20).view(2, 10) * 3
    labels = block_labels(tokens, torch.tensor([[0, 6], [2, 3]]), 3)
    assert labels.tolist() == [[[3, 6, 9], [21, 24, 27]], [[39, 42, 45], [42, 45, 48]]]


def test_loss_weights_decay_and_normalization():
    torch.testing.assert_close(
        loss_weights(4, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])
    )
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 3, 4, 11, generator=gen), torch.randint(0, 11, (2, 3, 4), generator=gen)
    for gamma in (0.5, 7.0):
        w = [math.exp(-k / gamma) for k in range(4)]
        ce = [
            [
                float(torch.nn.functional.cross_entropy(logits[b, a, k], labels[b, a, k]))
                for b in range(2)
                for a in range(3)
            ]
            for k in range(4)
        ]
        want = sum(wk * sum(c) / len(c) for wk, c in zip(w, ce)) / sum(w)
        assert float(dflash_loss(logits, labels, gamma)) == pytest.approx(want, rel=1e-5)
    # The same cross-entropy at every position: the normalized loss is that value for any gamma.
    flat = torch.zeros(2, 3, 4, 11)
    assert float(dflash_loss(flat, labels, 0.3)) == pytest.approx(math.log(11), rel=1e-6)


def test_chain_acceptance_counts_leading_hits_plus_bonus():
    labels = torch.tensor([[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]])
    guesses = torch.tensor([[[1, 2, 0, 4], [0, 2, 3, 4], [1, 2, 3, 4]]])
    logits = torch.nn.functional.one_hot(guesses, 5).float()
    assert chain_acceptance(logits, labels).tolist() == [[3.0, 1.0, 5.0]]
