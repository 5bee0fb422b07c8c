"""A tree round's commit in one launch (kernels.round_commit) against its reference
(engine.commit.commit_round_ref, the torch ops the accept stage ran) on fresh random rounds: accepted paths
of a tree (the root first, -1 padded), a finished request (count 0: its bonus token kept, its length
unchanged), a root alone (W = 1), the whole block accepted, token slots past W (the auto budget's copy:
zeroed), the drafter's context as a strided view of a wider buffer, feature widths that are not a
multiple of the column block, and what lies past the written columns left alone. Every output exactly
equal (copies and integer arithmetic); on CUDA against the CPU reference; bf16 and float32 features."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.engine.commit import RoundState, commit_round, commit_round_ref
from kdtree_engine.kernels.round_commit import commit_round as kernel_commit_round


def _round(seed: int, b: int, w: int, n: int, f: int, dtype=torch.float32):
    """Inputs of one round: per request an accepted path of node indices < n (root 0 first, increasing,
    -1 past its length), the count (its length, or 0 for an inactive request), a bonus token, the nodes'
    token ids and features."""
    gen = torch.Generator().manual_seed(seed)
    accepted = torch.full((b, w), -1, dtype=torch.int64)
    count = torch.randint(1, w + 1, (b,), generator=gen)
    for r in range(b):
        k = int(count[r])
        rest = torch.randperm(n - 1, generator=gen)[: k - 1] + 1
        accepted[r, :k] = torch.cat([torch.zeros(1, dtype=torch.int64), rest.sort().values])
    active = torch.rand(b, generator=gen) < 0.75
    count = count * active
    bonus = torch.randint(0, 1000, (b,), generator=gen)
    ids = torch.randint(0, 1000, (b, n), generator=gen)
    hidden = torch.randn(b, n, f, generator=gen).to(dtype)
    return count, accepted, bonus, ids, hidden, active


def _state(seed: int, b: int, w: int, f: int, slots: int, tail: int, dtype, device, ctx_rows: int):
    """A RoundState of random contents: ctx a view of the first w rows of a [b, ctx_rows, f] buffer,
    committed [b, 1 + slots + tail] (the tail stands for the auto budget's report)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ctx = torch.randn(b, ctx_rows, f, generator=gen).to(dtype).to(device)
    return RoundState(
        ctx=ctx[:, :w],
        ctx_lens=torch.randint(0, 50, (b,), generator=gen).to(device),
        committed=torch.randint(-9, 9, (b, 1 + slots + tail), generator=gen).to(device),
        bonus=torch.randint(0, 1000, (b,), generator=gen).to(device),
        start=torch.randint(0, 100, (b,), generator=gen).to(device),
    )


def _buffer(view: torch.Tensor) -> torch.Tensor:
    return view._base if view._base is not None else view


CASES = [  # (b, W, N, F, slots, tail, ctx rows)
    (1, 1, 1, 24, 1, 0, 1),  # a root alone
    (3, 4, 9, 40, 4, 0, 4),
    (5, 8, 33, 80, 8, 0, 8),  # kimi-nano's shape at budget 32 (W = block size)
    (4, 6, 17, 200, 16, 6, 96),  # auto: slots past W, a report tail, ctx a view of a wider buffer
    (2, 16, 65, 130, 16, 4, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_equals_reference(case, dtype, device):
    b, w, n, f, slots, tail, rows = case
    for seed in range(3):
        inputs = _round(seed, b, w, n, f, dtype)
        want = _state(seed, b, w, f, slots, tail, dtype, "cpu", rows)
        commit_round_ref(*inputs, want, slots)
        got = _state(seed, b, w, f, slots, tail, dtype, device, rows)
        kernel_commit_round(*(t.to(device) for t in inputs), got, slots)
        for name, g, e in zip(RoundState._fields, got, want, strict=True):
            assert torch.equal(g.cpu(), e), (seed, name)
        assert torch.equal(_buffer(got.ctx).cpu(), _buffer(want.ctx)), "rows past W of the context buffer"


def test_the_reference_commits_what_a_request_accepted():
    """The specification on a hand-made round: request 0 accepted nodes 0, 2, 5 and the bonus 77; request
    1 is done (count 0): its bonus token and length stay, its context rows are the root's."""
    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1]])
    count, bonus, active = torch.tensor([3, 0]), torch.tensor([77, 88]), torch.tensor([True, False])
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    hidden = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 2)
    out = RoundState(torch.zeros(2, 4, 2), torch.zeros(2, dtype=torch.int64), torch.full((2, 7), -5),
                     torch.tensor([1, 2]), torch.tensor([40, 50]))  # fmt: skip
    commit_round(count, accepted, bonus, ids, hidden, active, out, slots=6, impl="ref")
    assert out.committed.tolist() == [[3, 12, 15, 77, 77, 0, 0], [0, 88, 20, 20, 88, 0, 0]]
    assert out.ctx[0].tolist() == hidden[0, [0, 2, 5, 0]].tolist()
    assert out.ctx[1].tolist() == hidden[1, [0, 0, 0, 0]].tolist()
    assert out.ctx_lens.tolist() == [3, 0] and out.bonus.tolist() == [77, 2]
    assert out.start.tolist() == [43, 50]
