"""The router kernels (kernels/moe_router: route on given logits, route_hidden with the matmul as
partial logits) against model.moe.Router, on the CPU through the Triton interpreter at small shapes;
the realistic shapes and the CUDA-graph replay are marked gpu.

Router picks its top-k with topk(sorted=False), so ids are compared as sets per row (both sides sorted
by id, the weights carried along). Random normal logits have no near-ties: ids must match exactly;
the weights within rtol 1e-6 / atol 1e-7 (the sigmoid's exp may differ by an ulp from torch's on the
CPU, and the normalising sum is reduced in another order; route_hidden's logits, summed over chunks of
H, differ from F.linear's in the last bits). route_hidden's results for a token are the same bits
alone and in a batch. Where torch leaves ties open the kernel
takes the smaller index (groups and experts); those cases are checked against a brute-force rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdtree_engine.kernels.moe_router import logit_launch, route, route_hidden, router_logits
from kdtree_engine.model.moe import Router
from kdtree_engine.model.testing import tiny_config

# name: (E, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
CONFIGS = {
    "kimi": (384, 1, 1, 8, True, 2.827),
    "deepseek": (256, 8, 4, 8, True, 2.5),
    "e32": (32, 1, 1, 6, False, 1.0),
    "tiny": (8, 2, 1, 2, True, 2.5),
}
HIDDEN = 64


def make_router(name: str, seed: int) -> Router:
    e, groups, keep, k, norm, scaling = CONFIGS[name]
    c = tiny_config(
        n_routed_experts=e, n_group=groups, topk_group=keep, num_experts_per_tok=k, norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )  # fmt: skip
    router = Router(c)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, HIDDEN, generator=gen) * HIDDEN**-0.5)
        router.e_score_correction_bias.copy_(torch.randn(e, generator=gen) * 0.1)
    return router


def settings(router: Router) -> dict:
    c = router.c
    return dict(n_group=c.n_group, topk_group=c.topk_group, top_k=c.num_experts_per_tok,
                norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)  # fmt: skip


def route_like(router: Router, logits: torch.Tensor):
    c = router.c
    return route(
        logits, router.e_score_correction_bias, n_group=c.n_group, topk_group=c.topk_group,
        top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor,
    )  # fmt: skip


def by_id(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


def check_against_router(router: Router, x: torch.Tensor):
    want_w, want_ids = router(x)
    logits = F.linear(x.float(), router.weight)
    got_w, got_ids = route_like(router, logits)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert got_ids.shape == want_ids.shape
    got_w_s, got_ids_s = by_id(got_w, got_ids)
    want_w_s, want_ids_s = by_id(want_w, want_ids)
    assert torch.equal(got_ids_s, want_ids_s)
    torch.testing.assert_close(got_w_s, want_w_s, rtol=1e-6, atol=1e-7)
    # slots in descending choice value
    choice = logits.sigmoid() + router.e_score_correction_bias
    picked = choice.gather(1, got_ids)
    assert (picked[:, :-1] >= picked[:, 1:]).all()


@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_matches_router(name, n, device):
    router = make_router(name, seed=n).to(device)
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(100 + n)).to(device)
    check_against_router(router, x)


def make_wide_router(name: str, hidden: int, seed: int) -> Router:
    """make_router's router at another hidden size (weights N(0, 1/hidden))."""
    router = make_router(name, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    e = router.weight.shape[0]
    router.weight.data = torch.randn(e, hidden, generator=gen) * hidden**-0.5
    return router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 33])
@pytest.mark.parametrize("name, hidden", [("kimi", 600), ("deepseek", 64), ("e32", 512), ("tiny", 40)])
def test_route_hidden_matches_router(name, hidden, n, dtype, device):
    """Hidden sizes of 1 to 3 partial chunks (600: the last one partial), x in float32 and bf16."""
    router = make_wide_router(name, hidden, seed=n).to(device)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(300 + n)).to(device, dtype)
    want_w, want_ids = by_id(*router(x))
    got = route_hidden(x, router.weight, router.e_score_correction_bias, **settings(router))
    got_w, got_ids = by_id(*got)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hidden", [40, 600])
def test_router_logits_sum_to_the_matmul(hidden, device):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(21, hidden, generator=gen).bfloat16()
    weight = torch.randn(48, hidden, generator=gen) * hidden**-0.5
    parts = router_logits(x.to(device), weight.to(device)).cpu()
    assert parts.shape == (-(-hidden // logit_launch(hidden, 48).chunk), 21, 48)
    assert parts.dtype == torch.float32
    want = x.double() @ weight.double().T
    torch.testing.assert_close(parts.double().sum(0), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("name", ["kimi", "e32"])
def test_route_hidden_rows_do_not_depend_on_the_batch(name, device):
    """Each token's weights and ids alone equal its row in a batch of 40 (three row blocks of 16), bit
    for bit."""
    router = make_wide_router(name, 600, seed=5).to(device)
    x = torch.randn(40, 600, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    args = router.weight, router.e_score_correction_bias
    w, ids = route_hidden(x, *args, **settings(router))
    for i in (0, 15, 16, 39):
        w_i, ids_i = route_hidden(x[i : i + 1], *args, **settings(router))
        assert torch.equal(ids_i[0], ids[i]) and torch.equal(w_i[0], w[i]), i


def test_route_hidden_rejects_bad_arguments():
    router = make_router("tiny", seed=0)
    x = torch.zeros(2, HIDDEN)
    with pytest.raises(ValueError, match="weight"):
        route_hidden(x, router.weight.double(), router.e_score_correction_bias, **settings(router))
    with pytest.raises(ValueError, match="weight"):
        route_hidden(x[:, :8], router.weight, router.e_score_correction_bias, **settings(router))
    with pytest.raises(ValueError, match="top_k"):
        route_hidden(x, router.weight, router.e_score_correction_bias, **{**settings(router), "top_k": 9})


def tie_rule(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, k: int):
    """Brute force with the kernel's tie rule: groups by (top-2 sum desc, group asc), then experts of
    the kept groups by (choice desc, id asc). Returns ids [n, k] in slot order."""
    choice = logits.sigmoid() + bias
    size = logits.shape[1] // n_group
    group_scores = choice.view(len(logits), n_group, size).topk(2, dim=-1).values.sum(-1).tolist()
    rows = []
    for values, scores in zip(choice.tolist(), group_scores):
        groups = sorted(range(n_group), key=lambda g: (-scores[g], g))[:topk_group]
        experts = [g * size + j for g in groups for j in range(size)]
        rows.append(sorted(experts, key=lambda i: (-values[i], i))[:k])
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("name", ["kimi", "deepseek", "tiny"])
def test_all_equal_takes_smallest_ids(name, device):
    e, groups, keep, k, norm, scaling = CONFIGS[name]
    logits = torch.zeros(3, e, device=device)
    weights, ids = route(
        logits, torch.zeros(e, device=device), n_group=groups, topk_group=keep, top_k=k, norm_topk_prob=norm,
        scaling=scaling,
    )  # fmt: skip
    assert torch.equal(ids.cpu(), torch.arange(k).expand(3, k))
    want = torch.full((3, k), (1.0 / k if norm else 0.5) * scaling)
    torch.testing.assert_close(weights.cpu(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["kimi", "deepseek", "e32", "tiny"])
def test_plateaus_follow_tie_rule(name, device):
    """Logits from {0, 1, 2, 3}, bias 0: many equal experts and groups; distinct top-2 sums of those
    sigmoids are far apart, so only true ties are ties."""
    e, groups, keep, k, norm, scaling = CONFIGS[name]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 4, (9, e), generator=gen).float()
    bias = torch.zeros(e)
    weights, ids = route(
        logits.to(device), bias.to(device), n_group=groups, topk_group=keep, top_k=k, norm_topk_prob=norm,
        scaling=scaling,
    )  # fmt: skip
    want = tie_rule(logits, bias, groups, keep, k)
    assert torch.equal(ids.cpu(), want)
    w = logits.sigmoid().gather(1, want)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights.cpu(), w * scaling, rtol=1e-6, atol=1e-7)


def test_group_ties_take_smaller_group(device):
    """Groups with equal top-2 sums: the smaller group index is kept, whatever the order within."""
    # E 8, 2 groups keep 1, k 2: both groups score s(1) + s(0); group 0 wins -> ids 2 then 0
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    _, ids = route(logits.to(device), torch.zeros(8, device=device), n_group=2, topk_group=1, top_k=2,
                   norm_topk_prob=True, scaling=1.0)  # fmt: skip
    assert ids.cpu().tolist() == [[2, 0]]
    # equal sums of different pairs (scores 0.5 exactly, choices 0.75 + 0.75 = 1.0 + 0.5): group 0 is
    # kept although group 1 holds the best expert
    bias = torch.tensor([0.25, 0.25, -1.0, -1.0, 0.5, 0.0, -1.0, -1.0])
    _, ids = route(torch.zeros(1, 8, device=device), bias.to(device), n_group=2, topk_group=1, top_k=2,
                   norm_topk_prob=True, scaling=1.0)  # fmt: skip
    assert ids.cpu().tolist() == [[0, 1]]
    # E 256, 8 groups keep 4: every group a permutation of one another (all tie), but the bias lifts
    # group 5's best expert: groups 5, 0, 1, 2 are kept, and among equal values the smaller id goes first
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(32, generator=gen)
    logits = torch.stack([base[torch.randperm(32, generator=gen)] for _ in range(8)]).view(1, 256)
    bias = torch.zeros(256)
    best = 5 * 32 + int(logits.view(8, 32)[5].argmax())
    bias[best] = 0.01
    _, ids = route(logits.to(device), bias.to(device), n_group=8, topk_group=4, top_k=8,
                   norm_topk_prob=True, scaling=2.5)  # fmt: skip
    want = tie_rule(logits, bias, 8, 4, 8)
    assert torch.equal(ids.cpu(), want)
    assert int(want[0, 0]) == best and set((want // 32).flatten().tolist()) <= {0, 1, 2, 5}


def test_rejects_bad_arguments():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError):
        route(logits, torch.zeros(8), n_group=3, topk_group=1, top_k=2, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError):
        route(logits, torch.zeros(8), n_group=2, topk_group=1, top_k=5, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError):
        route(logits.double(), torch.zeros(8), n_group=1, topk_group=1, top_k=2, norm_topk_prob=True,
              scaling=1.0)  # fmt: skip


def test_empty_batch(device):
    weights, ids = route(torch.zeros(0, 8, device=device), torch.zeros(8, device=device), n_group=2,
                         topk_group=1, top_k=2, norm_topk_prob=True, scaling=1.0)  # fmt: skip
    assert weights.shape == ids.shape == (0, 2)


def test_makes_no_host_sync(device, monkeypatch):
    """No Tensor -> Python value conversion on the host (item, tolist, bool, int, float, nonzero)."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync")

    router = make_router("deepseek", seed=11).to(device)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(12)).to(device)
    logits = F.linear(x, router.weight)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = route_like(router, logits)
    monkeypatch.undo()
    want = router(x)
    assert torch.equal(by_id(*got)[1], by_id(*want)[1])


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("n", [1, 64, 2112])
@pytest.mark.parametrize("name", ["kimi", "deepseek"])
def test_route_realistic_cuda(name, n):
    router = make_router(name, seed=n).cuda()
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(200 + n)).cuda()
    logits = F.linear(x, router.weight)
    route_like(router, logits)  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = route_like(router, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = router(x)
    got_w, got_ids = by_id(*got)
    want_w, want_ids = by_id(*want)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    # libdevice expf and an IEEE division: unnormalised weights are torch's sigmoid to the bit
    c = router.c
    w, ids = route(logits, router.e_score_correction_bias, n_group=c.n_group, topk_group=c.topk_group,
                   top_k=c.num_experts_per_tok, norm_topk_prob=False, scaling=1.0)  # fmt: skip
    assert torch.equal(w, logits.sigmoid().gather(1, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33])
def test_cuda_graph_replay(n):
    """Captured once on static logits; replays after copying other logits in equal eager calls."""
    router = make_router("deepseek", seed=0).cuda()
    static = torch.randn(n, router.c.n_routed_experts, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        route_like(router, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_like(router, static)
    for seed in (1, 2, 3):
        gen = torch.Generator().manual_seed(seed)
        static.copy_(torch.randn(n, router.c.n_routed_experts, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids = route_like(router, static)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("n", [1, 33, 2112])
@pytest.mark.parametrize("name, hidden", [("kimi", 7168), ("e32", 2048)])
def test_route_hidden_realistic_cuda(name, hidden, n):
    """Kimi-K2's router (E 384, H 7168) and scaled-down Kimi's (E 32, H 2048) on bf16 rows: ids equal
    to Router's, weights close, no host sync, and each row equal to the row alone."""
    router = make_wide_router(name, hidden, seed=n).cuda()
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(400 + n)).bfloat16().cuda()
    args = router.weight, router.e_score_correction_bias
    route_hidden(x, *args, **settings(router))  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = route_hidden(x, *args, **settings(router))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got_w, got_ids = by_id(*got)
    want_w, want_ids = by_id(*router(x))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    for i in {0, n // 2, n - 1}:
        w_i, ids_i = route_hidden(x[i : i + 1], *args, **settings(router))
        assert torch.equal(ids_i[0], got[1][i]) and torch.equal(w_i[0], got[0][i]), i


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33])
def test_route_hidden_cuda_graph_replay(n):
    router = make_wide_router("e32", 2048, seed=0).cuda()
    args = router.weight, router.e_score_correction_bias
    static = torch.randn(n, 2048, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        route_hidden(static, *args, **settings(router))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_hidden(static, *args, **settings(router))
    for seed in (1, 2):
        static.copy_(torch.randn(n, 2048, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids = route_hidden(static, *args, **settings(router))
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
