"""The drop-in's graph replay (integrations/sglang/replay.py): the cache's order of eager run, capture and
replay (on the CPU, with a stand-in graph), and on CUDA that replays of the real functions on new
contents of the same buffers give what eager calls give."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kdtree_engine.integrations.sglang import replay as R

from .test_sglang_build import port_buffers, run, topk_inputs


class FakeGraph:
    """Counts replays; a capture runs the function (as the real capture records it)."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_cache_runs_eagerly_then_captures_then_replays(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: contextlib.nullcontext())
    cache, calls = R.GraphCache(capacity=2), []

    def fn(tag):
        calls.append(tag)
        return tag

    assert cache.call("a", lambda: fn("a")) == "a" and calls == ["a"]  # eager
    assert cache.call("a", lambda: fn("a")) == "a" and calls == ["a", "a"]  # captured (the fn runs once)
    graph = cache.graphs["a"][0]
    assert graph.replays == 1  # the capture is replayed at once: captured work does not run
    assert cache.call("a", lambda: fn("x")) == "a" and calls == ["a", "a"] and graph.replays == 2
    for key in ("b", "b", "c", "c"):
        cache.call(key, lambda k=key: fn(k))
    assert list(cache.graphs) == ["b", "c"]  # capacity 2: "a", least recently used, is gone


def test_keys_see_addresses_shapes_strides_and_dtypes():
    x = torch.zeros(4, 6)
    keys = {R._arg_key(t) for t in (x, x[:, :3], x.t(), x.view(torch.int32), x.clone(), x)}
    assert len(keys) == 5  # x twice is one key
    assert R._arg_key([1, 2]) == (1, 2) and R._arg_key(None) is None


def test_off_cuda_calls_are_eager(monkeypatch):
    seen = []
    monkeypatch.setattr(R.CACHE, "call", lambda key, fn: seen.append(key))

    @R.replayed(device_arg="x")
    def f(*, x):
        return x + 1

    assert torch.equal(f(x=torch.ones(2)), torch.full((2,), 2.0)) and seen == []


@pytest.mark.gpu
def test_replayed_build_follows_new_contents_of_the_same_buffers():
    budget, bs, dev = 16, 4, torch.device("cuda")
    bufs = port_buffers(bs, budget, dev)
    lp_buf, ids_buf = (t.to(dev) for t in topk_inputs(0, bs, 5, budget))
    R.CACHE.clear()
    for seed in range(5):  # eager, capture, then replays, each on new top-k contents
        lp, ids = topk_inputs(seed, bs, 5, budget)
        lp_buf.copy_(lp)
        ids_buf.copy_(ids)
        got = [t.clone() if isinstance(t, torch.Tensor) else t for t in run(lp_buf, ids_buf, budget, bufs)]
        want = run(lp, ids, budget, port_buffers(bs, budget))
        for i in (0, 1, 2, 4, 5):
            assert torch.equal(got[i].cpu(), want[i]), (seed, i)
    assert len(R.CACHE.graphs) == 1


@pytest.mark.gpu
def test_replayed_sampling_draws_fresh_uniforms_and_follows_them():
    """Each replay draws new uniforms into the caller's buffers and samples with them, exactly as the
    reference does from those uniforms."""
    from kdtree_engine.integrations.sglang.sample import sample_ddtree_target_probs_gpu
    from kdtree_engine.ref import sglang_sample as ref

    from .test_sglang_sample import OUTS, out_buffers, random_probs, random_trees

    g, dev, bs, q, vocab = torch.Generator().manual_seed(5), torch.device("cuda"), 8, 9, 40
    tokens, parents, sizes = random_trees(g, bs, q, vocab)
    probs = random_probs(g, tokens, parents, sizes, vocab).to(dev)
    ins = dict(
        target_probs=probs,
        draft_tokens=tokens.to(dev),
        parents=parents.to(dev),
        actual_tree_sizes=sizes.to(dev),
    )
    bufs = dict(out_buffers(bs, q, dev), uniform_samples=torch.empty(bs, q, device=dev),
                uniform_final=torch.empty(bs, device=dev))  # fmt: skip
    R.CACHE.clear()
    drawn = []
    for _ in range(4):  # eager, capture, two replays
        sample_ddtree_target_probs_gpu(**ins, **bufs)
        u, u_final = bufs["uniform_samples"].cpu(), bufs["uniform_final"].cpu()
        want = ref.sample_path(probs, tokens, parents, sizes, u, u_final)
        for name in OUTS:
            assert torch.equal(bufs[name].cpu(), getattr(want, name)), name
        drawn.append(u)
    assert len(R.CACHE.graphs) == 1 and not torch.equal(drawn[2], drawn[3])


@pytest.mark.gpu
def test_replayed_topk_follows_new_logits_in_the_same_buffer():
    from kdtree_engine.integrations.sglang.topk import whole_vocab_topk
    from kdtree_engine.ref import tree as ref_tree

    logits = torch.empty(30, 163840, dtype=torch.bfloat16, device="cuda")
    R.CACHE.clear()
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(30, 163840, generator=g) * 2).bfloat16()
        logits.copy_(x)
        lp, ids = whole_vocab_topk(logits, 32)
        want_lp, want_ids = ref_tree.logits_to_topk(x.unsqueeze(0), 32)
        assert torch.equal(lp.cpu(), want_lp[0]) and torch.equal(ids.cpu(), want_ids[0]), seed
    assert len(R.CACHE.graphs) == 1
