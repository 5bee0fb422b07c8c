"""engine.compare: where two greedy outputs parted and whether a near-tie explains it."""

from __future__ import annotations

import torch

from kdtree_engine.engine.compare import Divergence, explain, first_difference, tolerance
from kdtree_engine.model import greedy_generate
from tests.engine.helpers import random_prompts, tiny_target


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_explain_measures_the_margin_at_the_parting_point():
    target = tiny_target(0)
    prompts = random_prompts(1, [4, 6], target.config.vocab_size)
    greedy = greedy_generate(target, prompts, 6)
    assert explain(target, prompts, greedy, greedy) == []
    # replace request 1's token 3 by the target's runner-up there: a real choice, far from a tie in float32
    prefix = torch.tensor([prompts[1] + greedy[1][:3]])
    logits = target(prefix, target.new_cache(1, prefix.shape[1])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    other = [list(greedy[0]), greedy[1][:3] + [second, 0, 0]]
    (d,) = explain(target, prompts, greedy, other)
    assert (d.request, d.position, d.expected, d.got) == (1, 3, greedy[1][3], second)
    assert abs(d.margin - float(logits[greedy[1][3]] - logits[second])) < 1e-5
    assert not d.tie and "NOT explained" in d.describe()


def test_a_gap_within_rounding_is_a_tie_and_a_stop_is_not_a_choice():
    logits = torch.tensor([10.0, 9.99, -3.0])
    tol = tolerance(logits, torch.bfloat16)
    assert tol > 0.01 and tolerance(logits, torch.float32) < 1e-4
    assert Divergence(0, 5, 0, 1, 0.01, tol).tie
    assert not Divergence(0, 5, 0, 1, 0.01, tolerance(logits, torch.float32)).tie
    target = tiny_target(0)
    (d,) = explain(target, [[1, 2]], [[3, 4, 5]], [[3, 4]])
    assert d.tie and d.position == 2
