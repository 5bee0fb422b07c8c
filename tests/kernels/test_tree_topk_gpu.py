"""The vocabulary top-k and build_tree_from_logits compiled on CUDA against the reference run on the CPU
(on a CPU copy of the same logits, never the reference on CUDA): the log-probs bit-identical
(torch.equal), the ids and every tree field equal. Skipped without a CUDA GPU."""

from __future__ import annotations

import random

import pytest
import torch
from tests.kernels.test_tree_topk import FIELDS, grid_logits, make_logits, plateau_logits

from kdtree_engine import tree as T
from kdtree_engine.kernels import tree_topk
from kdtree_engine.ref import tree as ref

pytestmark = pytest.mark.gpu
KIMI_VOCAB = 163840


def assert_topk_equal(got, want) -> None:
    (lp, ids), (want_lp, want_ids) = got, want
    assert torch.equal(ids.cpu(), want_ids), f"ids differ at {(ids.cpu() != want_ids).nonzero()[:1].tolist()}"
    assert torch.equal(lp.cpu(), want_lp), f"log-probs differ by {(lp.cpu() - want_lp).abs().max().item()}"


def assert_same_tree(got, want) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@pytest.mark.parametrize("start", range(0, 400, 100))
def test_tie_heavy_small_vocab_fuzz_gpu(start):
    """Logits on a grid of 0.5 or 0.25, V in 1..8, L in 1..8, budgets 1..32, float32 / bf16 / fp16:
    exact score ties everywhere, so any last-bit difference of the normalizer changes the tree."""
    cuda = torch.device("cuda")
    for seed in range(start, start + 100):
        x, budget = grid_logits(seed)
        got = T.build_tree_from_logits(x.to(cuda), budget, impl="triton")
        assert_same_tree(got, T.build_tree_from_logits(x, budget, impl="ref"))
        k = min(budget, x.shape[-1])
        assert_topk_equal(tree_topk.logits_topk(x.to(cuda), k), ref.logits_to_topk(x, k))


def test_small_vocab_shape_of_the_report_gpu():
    """V = 3, L = 7, budget 16 on coarse grids, many seeds."""
    cuda = torch.device("cuda")
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        x = torch.round(torch.randn(4, 7, 3, generator=g) * 4) / 2
        got = T.build_tree_from_logits(x.to(cuda), 16, impl="triton")
        assert_same_tree(got, T.build_tree_from_logits(x, 16, impl="ref"))


@pytest.mark.parametrize("b,depth", [(1, 1), (3, 8), (2, 16)])
@pytest.mark.parametrize("kind", ["bf16", "smooth", "flat"])
def test_kimi_vocab_gpu(b, depth, kind):
    """V = 163840 bf16 rows: random, coarse (many ties) and constant (the exact path)."""
    cuda = torch.device("cuda")
    x = make_logits(b * depth, b, depth, KIMI_VOCAB, kind).bfloat16()
    want_lp, want_ids = ref.logits_to_topk(x, 100)
    for budget in (1, 8, 32, 64, 100):
        want = want_lp[..., :budget], want_ids[..., :budget]  # a prefix of the top-100 is the top-k
        assert_topk_equal(tree_topk.logits_topk(x.to(cuda), budget), want)
        got = T.build_tree_from_logits(x.to(cuda), budget)
        assert_same_tree(got, ref.build_tree(*want, budget))


PLATEAU_GPU = [  # (kind, dtype): every kind in bf16, the dtypes whose keys shift differently on some
    ("all_equal", torch.bfloat16),
    ("all_equal", torch.float32),
    ("all_but_three", torch.bfloat16),
    ("all_but_three", torch.float16),
    ("straddle", torch.bfloat16),
    ("straddle", torch.float32),
    ("few_values", torch.bfloat16),
    ("signed_zero", torch.bfloat16),
    ("signed_zero", torch.float32),
    ("coarse", torch.bfloat16),
    ("crowded", torch.bfloat16),
    ("crowded", torch.float32),
    ("crowded", torch.float16),
]


@pytest.mark.parametrize("b,depth", [(1, 1), (4, 15), (64, 15)])
@pytest.mark.parametrize("kind,dtype", PLATEAU_GPU, ids=lambda v: str(v).replace("torch.", ""))
def test_plateaus_kimi_vocab_gpu(kind, dtype, b, depth):
    """Plateaus and heavy ties at V = 163840 (the select's exact path; tests/kernels/test_tree_topk.py
    plateau_logits): top-k and trees against the CPU reference, on every 8th request at B = 64 (the
    kernels run on all 64 x 15 rows; the CPU reference is slow at that size)."""
    x = plateau_logits(kind, b * depth, b, depth, KIMI_VOCAB, 128).to(dtype)
    req = slice(None, None, 8 if b > 8 else 1)
    want_lp, want_ids = ref.logits_to_topk(x[req], 128)
    x = x.cuda()
    for budget in (1, 8, 32, 128):
        want = want_lp[..., :budget], want_ids[..., :budget]  # a prefix of the top-128 is the top-k
        lp, ids = tree_topk.logits_topk(x, budget)
        assert_topk_equal((lp[req], ids[req]), want)
        got = T.build_tree_from_logits(x, budget)
        expect = ref.build_tree(*want, budget)
        for f in FIELDS:
            assert torch.equal(getattr(got, f)[req].cpu(), getattr(expect, f)), f


def test_reference_is_device_independent_gpu():
    """The reference run on CUDA gives the CPU's bits too (it is made of exactly rounded operations)."""
    for seed in range(20):
        rnd = random.Random(seed)
        vocab = rnd.choice([1, 3, 8, 2049, KIMI_VOCAB])
        x = (torch.randn(2, 3, vocab, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
        assert_topk_equal(ref.logits_to_topk(x.cuda(), 16), ref.logits_to_topk(x, 16))


@pytest.mark.parametrize(
    "knobs", [{"max_groups": 8}, {"select_warps": 4}, {"select_warps": 1, "select_maxnreg": 128}]
)
def test_select_paths_and_launch_shapes_gpu(knobs):
    """The exact path forced at the Kimi vocab, and the select at 4 warps (the default for few rows)
    and 1 warp (each knob compiles its own select)."""
    x = make_logits(7, 2, 4, KIMI_VOCAB, "bf16").bfloat16()
    for budget in (8, 64):
        assert_topk_equal(tree_topk.logits_topk(x.cuda(), budget, **knobs), ref.logits_to_topk(x, budget))


def test_graph_and_streams_gpu():
    """The two launches captured in a CUDA graph and replayed on fresh logits, then run on three streams
    at once: equal to the reference (checked on a slice of rows: the CPU reference is slow at this size)."""
    dev = torch.device("cuda")
    xs = [make_logits(s, 64, 15, KIMI_VOCAB, "bf16").bfloat16().to(dev) for s in (11, 12, 13)]
    static = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tree_topk.logits_topk(static, 32)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_topk.logits_topk(static, 32)
    wants = [ref.logits_to_topk(x[::16].cpu(), 32) for x in xs]
    for x, want in zip(xs, wants):
        static.copy_(x)
        graph.replay()
        graph.replay()
        assert_topk_equal((out[0][::16], out[1][::16]), want)
    streams = [torch.cuda.Stream() for _ in xs]
    outs = []
    for s, x in zip(streams, xs):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(tree_topk.logits_topk(x, 32))
    torch.cuda.synchronize()
    for (lp, ids), want in zip(outs, wants):
        assert_topk_equal((lp[::16], ids[::16]), want)
