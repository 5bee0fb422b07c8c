"""DrafterTrainConfig (kdtree_engine.train.drafter_config): a bad value names its field; the pool specs it
makes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kdtree_engine.train.drafter_config import DrafterTrainConfig
from kdtree_engine.train.drafter_pool import PoolSpec

BASE = DrafterTrainConfig(
    target="t",
    data="d",
    out="o",
    num_attention_heads=4,
    num_key_value_heads=2,
    block_size=4,
    prompt_len=6,
    new_tokens=8,
    device="cpu",
)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_size": 1}, "block_size"),
        ({"anchors_per_seq": 0}, "anchors_per_seq"),
        ({"sampled_fraction": 1.5}, "sampled_fraction"),
        ({"new_tokens": 2}, "new_tokens"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"gamma": 0.0}, "gamma"),
        ({"max_steps": None, "minutes": None}, "max_steps"),
    ],
)
def test_bad_config_value_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"DrafterTrainConfig.{field}"):
        replace(BASE, **change)


def test_pool_specs_of_the_train_and_heldout_pools():
    cfg = replace(BASE, pool_sequences=10, sampled_fraction=0.25, pool_batch=3, target_layer_ids=[2, 0])
    assert cfg.target_layer_ids == (2, 0)
    assert cfg.pool_spec() == PoolSpec(
        sequences=10, prompt_len=6, new_tokens=8, sampled_fraction=0.25, batch=3
    )
    held = cfg.pool_spec(4)
    assert (held.sequences, held.seq_len, held.num_sampled) == (4, 14, 1)
