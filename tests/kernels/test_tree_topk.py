"""Vocab-wide top-k + log-softmax (kernels/tree_topk.py) and build_tree_from_logits on the GPU path.

How exactness is tested: the ids (and their order, ties -> smaller id first) must equal
ref.tree.topk_stable exactly; the log-probs are `logit - logsumexp` in float32 and the kernel sums
the exponentials in another order than torch, so they must agree within 1e-5 (a few float32 ulps
of a logsumexp near 12 for V = 163840); the tree built from logits must equal ref.build_tree applied
to the kernel's own top-k (the build itself is exact, test_tree_build.py).
"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine import tree as T
from kdtree_engine.kernels import tree_topk
from kdtree_engine.ref import tree as ref

ATOL = 1e-5


def make_logits(seed: int, b: int, depth: int, vocab: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, depth, vocab, generator=g) * 3
    if kind == "bf16":  # coarse bf16: many exact ties
        return torch.round(x).bfloat16()
    if kind == "half":
        return x.half()
    if kind == "flat":
        return torch.zeros(b, depth, vocab, dtype=torch.bfloat16)
    if kind == "signed_zero":
        x[..., ::3], x[..., 1::3] = 0.0, -0.0
    return x


def check_topk(x: torch.Tensor, k: int, device, want=None, **knobs) -> None:
    """want: the reference top-k for some k' >= k (the top-k is a prefix of the top-k')."""
    lp, ids = tree_topk.logits_topk(x.to(device), k, **knobs)
    want_lp, want_ids = ref.logits_to_topk(x, k) if want is None else (w[..., :k] for w in want)
    assert torch.equal(ids.cpu(), want_ids), f"ids differ at {(ids.cpu() != want_ids).nonzero()[:1].tolist()}"
    err = (lp.cpu() - want_lp).abs().max().item()
    assert err <= ATOL, f"worst log-prob error {err}"


CPU_CASES = [  # (b, depth, vocab, k, kind, knobs); no variant: the default, "thresh"
    (2, 2, 1000, 8, "smooth", {}),  # one chunk
    (1, 3, 1000, 16, "bf16", {"chunk": 256}),  # ties across 4 chunks
    (1, 2, 37, 37, "smooth", {"chunk": 16}),  # k = V > groups; V not a multiple of the group or chunk
    (1, 2, 300, 8, "flat", {"chunk": 64}),  # every logit ties, 5 chunks: slow path
    (1, 2, 3000, 16, "bf16", {"max_groups": 4}),  # forced slow path, 3 chunks
    (1, 1, 100, 60, "signed_zero", {}),  # -0.0 ties with +0.0
    (1, 2, 500, 5, "bf16", {"group": 16, "max_groups": 8}),
    (2, 2, 1000, 8, "smooth", {"variant": "compact"}),  # float32: unshifted keys
    (1, 3, 1000, 8, "bf16", {"variant": "compact"}),  # bf16: keys shifted by 16
    (1, 2, 1000, 8, "half", {"variant": "compact"}),  # fp16: keys shifted by 13
    (1, 3, 1000, 8, "bf16", {"variant": "compact", "max_compact": 16}),  # too many ties for KC
    (1, 2, 300, 8, "flat", {"variant": "compact"}),
    (1, 1, 100, 60, "signed_zero", {"variant": "compact"}),
]
THRESH_CASES = [  # the "thresh" select, run as two launches ("thresh") and as the fused one ("fused")
    (1, 2, 5000, 16, "bf16", {"chunk": 1024, "super_group": 128}),  # 5 chunks, V not a multiple
    (1, 2, 2000, 8, "half", {}),  # fp16: keys shifted by 13; 2 chunks
    (1, 1, 64, 64, "bf16", {"chunk": 16}),  # k = V with ties, k > number of groups and super groups
    (1, 3, 3000, 16, "bf16", {"max_compact": 16}),  # more logits >= T0 than KC: bisection path
    (
        1,
        2,
        1000,
        8,
        "smooth",
        {"super_group": 8, "select_warps": 2, "partial_warps": 2, "chunk": 128},
    ),  # S = G
]
CPU_CASES += [(*c[:5], {**c[5], "variant": v}) for c in THRESH_CASES for v in ("thresh", "fused")]
CPU_CASES += [  # the partials' per-group exps; V not a multiple of the chunk (a group wholly past V)
    (1, 3, 5000, 16, "bf16", {"chunk": 1024, "super_group": 128, "group_exp": True}),
    (2, 2, 1000, 8, "smooth", {"group_exp": True, "chunk": 256, "group": 16, "select_maxnreg": 64}),
]


@pytest.mark.parametrize(
    "case", CPU_CASES, ids=lambda c: "-".join(map(str, (*c[:5], c[5].get("variant", ""))))
)
def test_topk_matches_reference(case, device):
    b, depth, vocab, k, kind, knobs = case
    check_topk(make_logits(vocab + k, b, depth, vocab, kind), k, device, **knobs)


def test_fused_counter_is_left_zeroed(device):
    """The row counters of the fused launch end at zero, so a caller-kept buffer serves the next call
    (a counter left at NCH would make no program of the row its last, and no select would run)."""
    x = make_logits(5, 2, 2, 700, "bf16")
    counter = torch.zeros(4, dtype=torch.int32, device=device)
    for seed in (5, 6):  # two calls in a row on the same shapes and counter
        x = make_logits(seed, 2, 2, 700, "bf16")
        check_topk(x, 8, device, variant="fused", counter=counter, chunk=128)  # 6 chunks per row
        assert torch.equal(counter.cpu(), torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("counter,variant", [
    (torch.zeros(4, dtype=torch.int64), "fused"),
    (torch.zeros(3, dtype=torch.int32), "fused"),
    (torch.zeros(4, dtype=torch.int32), "thresh"),
])  # fmt: skip
def test_bad_counter_is_a_value_error(counter, variant):
    with pytest.raises(ValueError, match="counter"):
        tree_topk.logits_topk(torch.zeros(2, 2, 16), 2, variant=variant, counter=counter)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_build_from_logits_matches_reference(budget, device):
    x = make_logits(budget, 2, 3, 200, "bf16")
    got = T.build_tree_from_logits(x.to(device), budget, impl="triton")
    if budget:
        lp, ids = tree_topk.logits_topk(x.to(device), budget)
        want = ref.build_tree(lp.cpu(), ids.cpu(), budget)
    else:
        want = T.build_tree_from_logits(x, 0, impl="ref")
    for f in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@pytest.mark.gpu
@pytest.mark.parametrize("b,depth", [(1, 1), (3, 8), (3, 16), (64, 15)])
@pytest.mark.parametrize("kind", ["bf16", "smooth"])
def test_topk_kimi_vocab_gpu(b, depth, kind):
    device = torch.device("cuda")
    x = make_logits(b * depth, b, depth, 163840, kind)
    if kind == "smooth":
        x = x.bfloat16()
    want = ref.logits_to_topk(x, 100)
    for budget in (1, 8, 32, 64, 100):
        check_topk(x, budget, device, want)
        lp, ids = tree_topk.logits_topk(x.to(device), budget)
        got = T.build_tree_from_logits(x.to(device), budget)
        tree = ref.build_tree(lp.cpu(), ids.cpu(), budget)
        assert torch.equal(got.parents.cpu(), tree.parents) and torch.equal(got.tokens.cpu(), tree.tokens)


@pytest.mark.gpu
def test_topk_slow_path_gpu():
    device = torch.device("cuda")
    check_topk(make_logits(0, 2, 2, 163840, "flat"), 32, device)
    check_topk(make_logits(1, 2, 2, 20000, "bf16"), 64, device, max_groups=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "smooth", "flat"])
def test_topk_variants_gpu(kind):
    """Every top-k variant at the Kimi vocab (B = 64, L = 15); "thresh" and "fused" at both chunk sizes,
    "fused" with a caller-kept counter reused across calls."""
    x = make_logits(7, 64, 15, 163840, kind).bfloat16()
    want = ref.logits_to_topk(x, 64)
    counter = torch.zeros(64 * 15, dtype=torch.int32, device="cuda")
    for budget in (8, 32, 64):
        for knobs in ({"variant": "compact"}, {"variant": "thresh"}, {"variant": "fused"}, {"chunk": 4096},
                      {"variant": "fused", "chunk": 4096}, {"variant": "fused", "counter": counter},
                      {"variant": "fused", "counter": counter, "chunk": 4096}):  # fmt: skip
            check_topk(x, budget, torch.device("cuda"), want, **knobs)
    assert int(counter.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "flat"])
@pytest.mark.parametrize("knobs", [{"select_warps": 4}, {"select_warps": 1, "select_maxnreg": 128}])
def test_topk_select_warps_gpu(kind, knobs):
    """The select at 4 warps (the default for few rows; 2 warps capped at 128 registers at B = 64) and
    at 1, at the Kimi vocab (a test of its own: each knob compiles its own selects)."""
    x = make_logits(7, 64, 15, 163840, kind).bfloat16()
    want = ref.logits_to_topk(x, 64)
    for budget in (8, 64):
        check_topk(x, budget, torch.device("cuda"), want, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["thresh", "fused"])
def test_topk_graph_and_streams_gpu(variant):
    """The launches captured in a CUDA graph (for "fused", its counter memset with them) and replayed
    on fresh logits, then run on three streams at once (default counters): equal to the reference."""
    dev = torch.device("cuda")
    xs = [make_logits(s, 64, 15, 163840, "bf16").bfloat16().to(dev) for s in (11, 12, 13)]
    static = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tree_topk.logits_topk(static, 32, variant=variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_topk.logits_topk(static, 32, variant=variant)
    wants = [ref.logits_to_topk(x.cpu(), 32) for x in xs]
    for x, (want_lp, want_ids) in zip(xs, wants):
        static.copy_(x)
        graph.replay()
        graph.replay()
        assert torch.equal(out[1].cpu(), want_ids) and (out[0].cpu() - want_lp).abs().max() <= ATOL
    streams = [torch.cuda.Stream() for _ in xs]
    outs = []
    for s, x in zip(streams, xs):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(tree_topk.logits_topk(x, 32, variant=variant))
    torch.cuda.synchronize()
    for (lp, ids), (want_lp, want_ids) in zip(outs, wants):
        assert torch.equal(ids.cpu(), want_ids) and (lp.cpu() - want_lp).abs().max() <= ATOL


def test_unknown_variant_is_a_value_error():
    with pytest.raises(ValueError, match="variant"):
        tree_topk.logits_topk(torch.zeros(1, 1, 4), 2, variant="radix")
