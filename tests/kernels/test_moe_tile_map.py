"""The tile map of the MoE kernels (kernels.moe.tile_map: histogram, counting sort by expert and row
tiles in one launch) equal to its torch specification ref.moe.tile_map_ref, element for element, on
fresh random expert ids: ties within rows and across them, one expert taking every assignment, n = 1,
k = 1, n k not a multiple of the sort step or of BLOCK_M, E not a power of two, E = 384 with k = 8
(Kimi-K2), up to 2048 tokens. `order` must be the STABLE argsort: every case has experts with several
assignments, so an unstable or otherwise wrong order changes the tensor and fails torch.equal."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels import moe as kernels
from kdtree_engine.ref.moe import tile_map_ref


def make_ids(n: int, k: int, n_experts: int, kind: str, seed: int) -> torch.Tensor:
    """ids [n, k] int64 in 0..E-1: "distinct" (k distinct experts per row, as a router picks them);
    "repeat" (independent draws: ties within rows too); "one" (every assignment to expert E - 1: all
    other experts empty); "two" (only experts 0 and E // 2)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        return torch.rand(n, n_experts, generator=gen).argsort(dim=1)[:, :k]
    if kind == "repeat":
        return torch.randint(0, n_experts, (n, k), generator=gen)
    if kind == "one":
        return torch.full((n, k), n_experts - 1, dtype=torch.int64)
    return torch.randint(0, 2, (n, k), generator=gen) * (n_experts // 2)


CASES = [  # (n, k, E, kind)
    (1, 1, 4, "distinct"),  # n = 1, k = 1: one assignment
    (1, 8, 384, "distinct"),  # Kimi-K2 decode
    (1, 6, 32, "one"),  # every assignment to one expert (ties within the row)
    (7, 1, 5, "repeat"),  # k = 1, E not a power of two
    (33, 6, 32, "distinct"),  # a verify of 33 nodes, scaled-down Kimi
    (33, 8, 384, "distinct"),  # 264 assignments: 33 sort steps of 8 at E = 384
    (33, 8, 384, "repeat"),
    (41, 3, 7, "repeat"),  # 123 assignments: not a multiple of the 256-row sort step nor of BLOCK_M
    (100, 2, 3, "two"),  # an expert empty in the middle
    (300, 4, 16, "one"),  # 1200 assignments to one expert: 75 tiles of 16, two histogram chunks
    (517, 6, 33, "repeat"),  # E = 33: padded to 64
    (2048, 8, 384, "distinct"),  # prefill, Kimi-K2: 16384 assignments
    (2048, 2, 8, "repeat"),
]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_tile_map_equals_reference(case, block_m, device):
    n, k, n_experts, kind = case
    if n * k > 4096 and block_m == 64:
        pytest.skip("one BLOCK_M is enough at the largest shapes (interpreter time)")
    ids = make_ids(n, k, n_experts, kind, seed=n * 1000 + k)
    counts = torch.bincount(ids.flatten(), minlength=n_experts)
    assert int(counts.max()) >= 2 or n == 1  # stability is tested: some expert has several rows
    want = tile_map_ref(ids, n_experts, block_m)
    got = [t.cpu() for t in kernels.tile_map(ids.to(device), n_experts, block_m)]
    for name, g, w in zip(("order", "bounds", "tile_expert", "tile_row"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        bad = (g != w).nonzero()
        assert len(bad) == 0, f"{name}: {len(bad)} entries differ, first at {bad[0].tolist()}"


def test_reference_is_the_stable_argsort_and_tiles_cover_each_row_once():
    """tile_map_ref's own properties: order is the stable argsort; the real tiles come first, each
    inside one expert's rows; every sorted row is in exactly one tile; idle tiles are (E, 0)."""
    n, k, n_experts, block_m = 40, 3, 5, 16
    ids = make_ids(n, k, n_experts, "repeat", seed=3)
    order, bounds, tile_expert, tile_row = tile_map_ref(ids, n_experts, block_m)
    flat = ids.flatten()
    assert torch.equal(order, flat.argsort(stable=True))
    assert torch.equal(flat[order], flat.sort().values)
    assert len(tile_expert) == kernels.max_tiles(n * k, n_experts, block_m)
    real = int((tile_expert < n_experts).sum())
    assert bool((tile_expert[real:] == n_experts).all()) and bool((tile_row[real:] == 0).all())
    assert_tiles_cover_each_row_once(flat, order, bounds, tile_expert, tile_row, real, block_m)


def assert_tiles_cover_each_row_once(flat, order, bounds, tile_expert, tile_row, real: int, block_m: int):
    """The first `real` tiles each lie inside one expert's sorted rows, hold only that expert's
    assignments, and together cover every sorted row exactly once (flat: the ids, flattened)."""
    covered = torch.zeros(len(flat), dtype=torch.long)
    for t in range(real):
        e, r0 = int(tile_expert[t]), int(tile_row[t])
        r1 = min(r0 + block_m, int(bounds[e + 1]))
        assert int(bounds[e]) <= r0 < r1
        covered[r0:r1] += 1
        assert bool((flat[order[r0:r1]] == e).all())
    assert bool((covered == 1).all())


def test_sort_rows_is_a_power_of_two_within_its_cells():
    for n_experts in (1, 3, 16, 32, 33, 256, 384, 1024):
        rows = kernels.sort_rows(n_experts)
        assert 8 <= rows <= 256 and not rows & (rows - 1)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("case", [(1, 8, 48, 0.9), (33, 8, 48, 0.85), (41, 3, 7, 0.4), (300, 4, 16, 1.0)],
                         ids=lambda c: "-".join(map(str, c)))  # fmt: skip
def test_tile_map_skips_experts_of_other_ranks(case, block_m, device):
    """ids with a share of -1 (expert parallelism; all -1 in the last case): bounds and tiles equal the
    reference's, and order's rows below bounds[E] (the assignments held here) too."""
    n, k, n_experts, remote = case
    ids = make_ids(n, k, n_experts, "repeat", seed=n + k)
    gen = torch.Generator().manual_seed(n)
    ids = torch.where(torch.rand(n, k, generator=gen) < remote, torch.full_like(ids, -1), ids)
    want = tile_map_ref(ids, n_experts, block_m)
    got = [t.cpu() for t in kernels.tile_map(ids.to(device), n_experts, block_m)]
    held = int(want[1][-1])
    assert held == int((ids >= 0).sum())
    assert torch.equal(got[0][:held], want[0][:held])
    for name, g, w in zip(("bounds", "tile_expert", "tile_row"), got[1:], want[1:]):
        assert torch.equal(g, w), name
