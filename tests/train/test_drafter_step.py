"""Batches, the optimizer step and the anchors of drafter training (kdtree_engine.train.drafter_step) on
a tiny random target, float32, CPU."""

from __future__ import annotations

import math

import pytest
import torch

from kdtree_engine.drafter import DFlashDrafter, tiny_drafter_config
from kdtree_engine.model import random_model, tiny_config
from kdtree_engine.train.drafter_pool import Pool, target_features
from kdtree_engine.train.drafter_step import Batch, anchor_range, random_batch, sample_anchors, train_step

LAYERS = (0, 2)


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(), seed=0).requires_grad_(False)


def test_overfitting_one_batch_lowers_the_loss(target):
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_drafter_config(target.config, block_size=4, target_layer_ids=LAYERS))
    tokens = torch.randint(0, 128, (4, 14), generator=torch.Generator().manual_seed(5))
    batch = Batch(
        tokens, target_features(target, tokens, LAYERS), sample_anchors(4, 3, 3, 10, torch.Generator())
    )
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = [float(train_step(drafter, target, batch, opt, gamma=7.0, grad_clip=1.0)) for _ in range(30)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_sample_anchors_range_distinct_and_seeded():
    a = sample_anchors(200, 4, 3, 9, torch.Generator().manual_seed(0))
    assert a.min() == 3 and a.max() == 9
    assert all(len(set(row)) == 4 for row in a.tolist())
    assert torch.equal(a, sample_anchors(200, 4, 3, 9, torch.Generator().manual_seed(0)))
    many = sample_anchors(5, 6, 2, 3, torch.Generator())  # more anchors than positions: with replacement
    assert many.shape == (5, 6) and set(many.unique().tolist()) <= {2, 3}


def test_random_batch_rows_of_the_pool_and_anchors_in_its_continuation():
    tokens = torch.arange(5 * 12).view(5, 12)
    pool = Pool(tokens, tokens[..., None].float().expand(5, 12, 3), prompt_len=4)
    assert anchor_range(pool, block_size=4) == (3, 8)  # the last prompt token .. the last full block
    batch = random_batch(pool, batch=7, anchors=3, block_size=4, gen=torch.Generator().manual_seed(0))
    assert batch.tokens.shape == (7, 12) and batch.anchors.shape == (7, 3)
    assert batch.anchors.min() >= 3 and batch.anchors.max() <= 8
    rows = batch.tokens[:, 0] // 12
    assert torch.equal(batch.tokens, tokens[rows]) and torch.equal(
        batch.features[..., 0], batch.tokens.float()
    )
    assert torch.equal(batch.labels(3)[:, :, 0], batch.tokens.gather(1, batch.anchors + 1))
