"""Routed experts: ref.moe against the per-expert loop of model.moe.MoE.routed (bit for bit), and the
grouped Triton kernels (kernels/moe.py) against the reference, on the CPU through the Triton
interpreter at small shapes; the realistic shapes and the CUDA-graph replay are marked gpu.

Tolerances, relative to the output's largest magnitude: float32 1e-4 (the kernels accumulate in
float32 in another order); bf16 / fp16 inputs 1e-2 against the reference run in float32 on the same
16-bit values (the kernels round h and the output to 16 bits, the reference nothing), 3e-2 against
the reference run in the 16-bit dtype (which also rounds every expert's output and partial sum).
"""

from __future__ import annotations

import pytest
import torch
from test_moe_tile_map import assert_tiles_cover_each_row_once  # same folder (no package)
from torch import nn

from kdtree_engine.kernels import moe as kernels
from kdtree_engine.model.moe import MLP
from kdtree_engine.ref.moe import moe_experts_ref

LOW = (torch.bfloat16, torch.float16)


def make_experts(n_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> nn.ModuleList:
    """Per-expert SwiGLU modules (model.moe.MLP: gate_proj, up_proj, down_proj nn.Linear), weights
    N(0, 1/fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    experts = nn.ModuleList(MLP(hidden, inter) for _ in range(n_experts))
    with torch.no_grad():
        for _, p in sorted(experts.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.shape[1] ** -0.5)
    return experts.to(dtype)


def stack_experts(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights as w_gate_up [E, 2I, H] and w_down [E, H, I]."""
    w_gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
    return w_gate_up.detach(), torch.stack([e.down_proj.weight for e in experts]).detach()


@torch.no_grad()
def routed_per_expert(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """MoE.routed of model.moe as it was with per-expert modules (a loop over the experts in use, one
    host sync), kept verbatim: the behaviour ref.moe.moe_experts_ref must reproduce bit for bit."""
    k = ids.shape[1]
    order = ids.flatten().argsort(stable=True)  # [n * k] assignment slots grouped by expert
    counts = torch.bincount(ids.flatten(), minlength=len(experts)).tolist()
    out = torch.zeros_like(x)
    begin = 0
    for e, count in enumerate(counts):
        if count:
            chosen = order[begin : begin + count]
            token, slot = chosen // k, chosen % k
            y = experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        begin += count
    return out


def make_routing(n: int, k: int, n_experts: int, kind: str, gen: torch.Generator):
    """weights [n, k] float32 in (0, 2.5), ids [n, k] distinct per row: "random"; "hot" (expert 1 in
    every row, first slot); "low" (only experts 0..k-1, every other expert unused)."""
    ids = torch.rand(n, n_experts, generator=gen).argsort(dim=1)[:, :k]
    if kind == "hot":
        others = torch.rand(n, n_experts - 1, generator=gen).argsort(dim=1)[:, : k - 1]
        ids = torch.cat([torch.ones(n, 1, dtype=torch.int64), others + (others >= 1).long()], dim=1)
    elif kind == "low":
        ids = torch.rand(n, k, generator=gen).argsort(dim=1)
    weights = torch.rand(n, k, generator=gen) * 2.5
    return weights, ids


def make_inputs(n, k, n_experts, hidden, inter, dtype, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    weights, ids = make_routing(n, k, n_experts, kind, gen)
    w_gate_up = (torch.randn(n_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w_down = (torch.randn(n_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    return x, weights, ids, w_gate_up, w_down


REF_CASES = [  # (n, k, E, H, I, kind)
    (1, 1, 4, 16, 16, "random"),  # n = 1, k = 1: one expert used, three unused
    (1, 2, 8, 64, 32, "random"),  # experts unused
    (7, 1, 4, 40, 24, "hot"),  # k = 1: one expert takes every token
    (9, 3, 6, 40, 24, "hot"),  # H, I not multiples of 16; expert 1 in every row
    (20, 2, 8, 24, 8, "low"),  # experts 2..7 unused
    (33, 4, 8, 64, 48, "random"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ref_equals_moe_routed(case, dtype):
    n, k, n_experts, hidden, inter, kind = case
    experts = make_experts(n_experts, hidden, inter, dtype, seed=n + k)
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    weights, ids = make_routing(n, k, n_experts, kind, gen)
    want = routed_per_expert(experts, x, weights, ids)
    got = moe_experts_ref(x, weights, ids, *stack_experts(experts))
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_ref_rejects_bad_arguments():
    x, weights, ids, w_gate_up, w_down = make_inputs(2, 2, 4, 16, 8, torch.float32, "random", 0)
    with pytest.raises(ValueError, match="dtype"):
        moe_experts_ref(x, weights, ids, w_gate_up.bfloat16(), w_down)
    with pytest.raises(ValueError, match="int64"):
        moe_experts_ref(x, weights, ids.int(), w_gate_up, w_down)
    with pytest.raises(ValueError, match="w_down"):
        moe_experts_ref(x, weights, ids, w_gate_up, w_down[:, :, :4])


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("n, k, n_experts, kind", [(1, 1, 4, "random"), (5, 2, 8, "low"), (40, 3, 5, "hot"),
                                                   (100, 2, 3, "random"), (33, 6, 32, "random")])  # fmt: skip
def test_tile_map(n, k, n_experts, kind, block_m, device):
    """Every sorted row lies in exactly one real tile, of its expert; tiles never straddle experts;
    the tiles past the real ones are idle (expert E); order is the stable argsort."""
    ids = make_routing(n, k, n_experts, kind, torch.Generator().manual_seed(n))[1]
    mapped = kernels.tile_map(ids.to(device), n_experts, block_m)
    order, bounds, tile_expert, tile_row = (t.cpu() for t in mapped)
    flat = ids.flatten()
    assert torch.equal(order, flat.argsort(stable=True))
    counts = torch.bincount(flat, minlength=n_experts)
    assert torch.equal(bounds.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    assert len(tile_expert) == kernels.max_tiles(n * k, n_experts, block_m)
    real = tile_expert < n_experts
    assert bool(real.sum() == (counts + block_m - 1).div(block_m, rounding_mode="floor").sum())
    assert bool(real[: int(real.sum())].all())  # the real tiles come first
    assert_tiles_cover_each_row_once(flat, order, bounds, tile_expert, tile_row, int(real.sum()), block_m)


KERNEL_CASES = [  # (n, k, E, H, I, kind); the launch (BLOCK_M) follows n k and E
    (1, 1, 4, 16, 16, "random"),
    (1, 2, 8, 40, 24, "random"),  # H, I not multiples of 16
    (5, 2, 8, 64, 32, "low"),  # experts unused
    (18, 1, 3, 24, 40, "hot"),  # one expert takes every token: two tiles, the second partial
    (40, 3, 4, 48, 20, "hot"),  # several tiles per expert, all experts used
    (66, 2, 18, 32, 24, "random"),  # 132 assignments, 7.3 per expert: BLOCK_M 16
    (50, 3, 8, 24, 40, "hot"),  # BLOCK_M 32
    (70, 2, 4, 40, 16, "random"),  # BLOCK_M 64
]


def test_launch_config():
    assert [kernels.launch_config(a, e, 2).block_m for a, e in [(6, 32), (144, 18), (150, 8), (140, 4)]] == [
        16, 16, 32, 64]  # fmt: skip
    for a, e, size in [(6, 32, 2), (6, 32, 4), (12672, 32, 2), (512, 256, 4)]:
        launch = kernels.launch_config(a, e, size)
        for b in (launch.gate_up, launch.down):  # power-of-two blocks, tl.dot's minimum 16
            assert b.block_n >= 16 and b.block_k >= 16 and not b.block_n & (b.block_n - 1)


def check_kernel(case, dtype, device, seed=0):
    n, k, n_experts, hidden, inter, kind = case
    inputs = make_inputs(n, k, n_experts, hidden, inter, dtype, kind, seed + n)
    got = kernels.moe_experts(*(t.to(device) for t in inputs))
    assert got.dtype == dtype and got.shape == (n, hidden)
    got = got.cpu().float()
    x, weights, ids, w_gate_up, w_down = inputs
    exact = moe_experts_ref(x.float(), weights, ids, w_gate_up.float(), w_down.float())
    scale = float(exact.abs().max())
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, exact, rtol=tol, atol=tol * scale)
    if dtype in LOW:
        same_dtype = moe_experts_ref(*inputs).float()
        torch.testing.assert_close(got, same_dtype, rtol=3e-2, atol=3e-2 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference(case, dtype, device):
    check_kernel(case, dtype, device)


def test_kernel_float16(device):
    check_kernel((12, 2, 4, 32, 24, "random"), torch.float16, device)


def test_kernel_float64_runs_the_reference(device):
    inputs = [t.to(device) for t in make_inputs(6, 2, 4, 24, 16, torch.float64, "random", 3)]
    assert torch.equal(kernels.moe_experts(*inputs), moe_experts_ref(*inputs))


def test_kernel_is_deterministic(device):
    inputs = [t.to(device) for t in make_inputs(40, 3, 4, 48, 20, torch.float32, "random", 5)]
    assert torch.equal(kernels.moe_experts(*inputs), kernels.moe_experts(*inputs))


def test_kernel_makes_no_host_sync(device, monkeypatch):
    """No Tensor -> Python value conversion on the host (item, tolist, bool, int, float, nonzero)."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync")

    inputs = [t.to(device) for t in make_inputs(9, 2, 4, 32, 16, torch.float32, "random", 7)]
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = kernels.moe_experts(*inputs)
    monkeypatch.undo()
    torch.testing.assert_close(got.cpu(), moe_experts_ref(*(t.cpu() for t in inputs)), rtol=1e-4, atol=1e-4)


GPU_SHAPE = dict(n_experts=32, k=6, hidden=2048, inter=768)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("n", [1, 33, 64 * 33])
def test_kernel_realistic_shape_bf16(n):
    s = GPU_SHAPE
    inputs = make_inputs(n, s["k"], s["n_experts"], s["hidden"], s["inter"], torch.bfloat16, "random", n)
    x, weights, ids, w_gate_up, w_down = (t.cuda() for t in inputs)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = kernels.moe_experts(x, weights, ids, w_gate_up, w_down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = moe_experts_ref(x.float(), weights, ids, w_gate_up.float(), w_down.float())
    scale = float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * scale)
    assert torch.equal(got, kernels.moe_experts(x, weights, ids, w_gate_up, w_down))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33])
def test_kernel_cuda_graph_replay(n):
    """Captured once on static inputs; replays after copying other x / weights / ids into them equal
    eager calls on the same inputs."""
    s = GPU_SHAPE
    args = (n, s["k"], s["n_experts"], s["hidden"], s["inter"], torch.bfloat16)
    static = [t.cuda() for t in make_inputs(*args, "random", 0)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        kernels.moe_experts(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(*static)
    for seed, kind in [(1, "random"), (2, "hot"), (3, "low")]:
        fresh = [t.cuda() for t in make_inputs(*args, kind, seed)]
        for dst, src in zip(static[:3], fresh[:3]):  # x, weights, ids; the expert weights stay
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kernels.moe_experts(*static[:3], *static[3:]))


def split_by_rank(ids: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    """ids as one rank of expert parallelism sees them: its experts rank * per_rank .. + per_rank - 1
    renumbered from 0, every other expert -1."""
    local = ids - rank * per_rank
    return torch.where((local >= 0) & (local < per_rank), local, torch.full_like(ids, -1))


@pytest.mark.parametrize("ranks", [2, 4])
def test_ref_expert_parallel_ranks_sum_to_the_whole(ranks):
    """Each rank holding E / ranks experts and computing its share (the others' ids -1): the shares
    add up to the whole layer's output (float64: equal up to the order of the additions)."""
    n, k, n_experts, hidden, inter = 13, 3, 8, 24, 16
    inputs = make_inputs(n, k, n_experts, hidden, inter, torch.float64, "random", 4)
    x, weights, ids, w_gate_up, w_down = inputs
    per = n_experts // ranks
    shares = [
        moe_experts_ref(x, weights, split_by_rank(ids, r, per), w_gate_up[r * per : (r + 1) * per],
                        w_down[r * per : (r + 1) * per])
        for r in range(ranks)
    ]  # fmt: skip
    assert any(bool((split_by_rank(ids, r, per) < 0).any()) for r in range(ranks))
    whole = moe_experts_ref(*inputs)
    torch.testing.assert_close(sum(shares), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [(1, 8, 48, 32, 16, 0.9), (9, 4, 6, 40, 24, 0.5), (33, 4, 8, 32, 16, 1.0),
                                  (70, 2, 4, 40, 16, 0.3)], ids=lambda c: "-".join(map(str, c)))  # fmt: skip
def test_kernel_skips_experts_of_other_ranks(case, dtype, device):
    """ids with a share of -1 (experts on other ranks; a whole token's row of -1 included): the kernel
    equals the reference, which leaves those choices out, with and without the shared expert."""
    n, k, n_experts, hidden, inter, remote = case
    x, weights, ids, w_gate_up, w_down = make_inputs(n, k, n_experts, hidden, inter, dtype, "random", n)
    gen = torch.Generator().manual_seed(n + 1)
    ids = torch.where(torch.rand(n, k, generator=gen) < remote, torch.full_like(ids, -1), ids)
    ids[0] = -1  # a token none of whose experts is here
    gen_shared = torch.Generator().manual_seed(7)
    shared = tuple((torch.randn(s, generator=gen_shared) * s[1] ** -0.5).to(dtype)
                   for s in [(inter, hidden), (inter, hidden), (hidden, inter)])  # fmt: skip
    for extra in (None, shared):
        on_device = None if extra is None else tuple(w.to(device) for w in extra)
        got = kernels.moe_experts(*(t.to(device) for t in (x, weights, ids, w_gate_up, w_down)), on_device)
        exact = moe_experts_ref(x.float(), weights, ids, w_gate_up.float(), w_down.float(),
                                None if extra is None else tuple(w.float() for w in extra))  # fmt: skip
        got = got.cpu().float()
        scale = max(float(exact.abs().max()), 1e-6)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, exact, rtol=tol, atol=tol * scale)
        if extra is None:
            assert bool((got[0] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33, 16 * 33])
def test_kernel_expert_parallel_rank_at_kimi_shape(n):
    """One rank of Kimi-K2 under 8-way expert parallelism (48 of 384 experts, H 7168, I 2048, top-8, the
    shared expert's 256-wide slice), bf16: the kernel against the float32 reference, and captured in a
    graph."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.rand(n, 384, generator=gen).argsort(dim=1)[:, :8]
    local = torch.where(ids < 48, ids, torch.full_like(ids, -1)).cuda()
    x = torch.randn(n, 7168, generator=gen).bfloat16().cuda()
    weights = torch.rand(n, 8, generator=gen).cuda()
    w_gate_up = (torch.randn(48, 4096, 7168, device="cuda") * 7168**-0.5).bfloat16()
    w_down = (torch.randn(48, 7168, 2048, device="cuda") * 2048**-0.5).bfloat16()
    shared = tuple(
        (torch.randn(s, device="cuda") * s[1] ** -0.5).bfloat16()
        for s in [(256, 7168), (256, 7168), (7168, 256)]
    )
    got = kernels.moe_experts(x, weights, local, w_gate_up, w_down, shared)
    want = moe_experts_ref(
        x.float(), weights, local, w_gate_up.float(), w_down.float(), tuple(w.float() for w in shared)
    )
    scale = float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(x, weights, local, w_gate_up, w_down, shared)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
