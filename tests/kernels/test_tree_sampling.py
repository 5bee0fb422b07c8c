"""Sampled accept: the Triton path equals the reference given the same Gumbel noise, the rule means
what it says (top-k / top-p / temperature), and bad arguments raise ValueErrors naming them."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine import tree as T
from kdtree_engine.kernels import tree_sample as kernels
from kdtree_engine.ref import sampling
from kdtree_engine.ref import tree as ref


def setup(seed: int, b: int, depth: int, budget: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    lp, ids = ref.logits_to_topk(torch.randn(b, depth, vocab, generator=g), min(budget, vocab))
    tree = ref.build_tree(lp, ids, budget)
    logits = torch.round(torch.randn(b, budget + 1, vocab, generator=g) * 4).bfloat16()  # many ties
    noise = sampling.gumbel_noise(logits.shape, generator=g)
    return tree, logits, noise


def to(tree, device):
    parts = (getattr(tree, f).to(device) for f in ("tokens", "depths", "parents", "num_nodes"))
    return T.DraftTree(*parts, tree.max_depth)


OPTIONS = [
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=5),
    dict(temperature=1.4, top_p=0.7),
    dict(temperature=0.8, top_k=10, top_p=0.5),
    dict(temperature=3.0, top_k=1),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_kernel_equals_reference_given_noise(opts, device):
    tree, logits, noise = setup(len(opts), 3, 4, 8, 40)
    got, got_tok = T.accept_sampled(
        to(tree, device), logits.to(device), noise=noise.to(device), impl="triton", **opts
    )
    want, want_tok = T.accept_sampled(tree, logits, noise=noise, impl="ref", **opts)
    assert torch.equal(got_tok.cpu(), want_tok)
    for f in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


def test_rule_semantics():
    tree, logits, noise = setup(7, 2, 3, 6, 30)
    x = logits.float()
    _, top1 = T.accept_sampled(tree, logits, temperature=2.0, top_k=1, noise=noise, impl="ref")
    assert torch.equal(x.gather(-1, top1[..., None])[..., 0], x.max(-1).values)  # top_k=1: a max logit
    _, nucleus = T.accept_sampled(tree, logits, temperature=1.0, top_p=1e-6, noise=noise, impl="ref")
    assert torch.equal(x.gather(-1, nucleus[..., None])[..., 0], x.max(-1).values)
    _, tok = T.accept_sampled(tree, logits, temperature=1.0, top_k=4, noise=noise, impl="ref")
    assert bool((x.gather(-1, tok[..., None])[..., 0] >= x.topk(4, -1).values[..., -1]).all())
    acc, sampled = T.accept_sampled(tree, logits, temperature=1.0, noise=noise, impl="ref")
    assert torch.equal(acc.accepted, ref.accept_greedy(tree, sampled).accepted)


def test_generator_is_deterministic():
    tree, logits, _ = setup(3, 2, 3, 6, 30)
    runs = [
        T.accept_sampled(
            tree, logits, temperature=1.0, generator=torch.Generator().manual_seed(5), impl="ref"
        )[1]
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e-50), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, noise=torch.zeros(2, 7, 29)), "noise"),
        (dict(temperature=1.0, noise=torch.zeros(2, 7, 30), generator=torch.Generator()), "noise"),
        (dict(temperature=1.0, generator="seed"), "generator"),
        (dict(temperature=1.0, logits=torch.zeros(2, 6, 30)), "target_logits"),
        (dict(temperature=1.0, logits=torch.zeros(2, 7, 30, dtype=torch.long)), "target_logits"),
    ],
)
def test_bad_arguments(kwargs, match):
    tree, logits, _ = setup(1, 2, 3, 6, 30)
    logits = kwargs.pop("logits", logits)
    with pytest.raises(ValueError, match=match):
        T.accept_sampled(tree, logits, impl="ref", **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_sampled_kimi_vocab_gpu(b):
    tree, logits, noise = setup(b, b, 15, 32, 163840)
    cuda = torch.device("cuda")
    for opts in OPTIONS:
        got, tok = T.accept_sampled(to(tree, cuda), logits.to(cuda), noise=noise.to(cuda), **opts)
        want, want_tok = T.accept_sampled(tree, logits, noise=noise, impl="ref", **opts)
        if "top_p" not in opts:  # top-p cutoffs are computed on each device; compare with shared ones
            assert torch.equal(tok.cpu(), want_tok)
        cut = sampling.sampling_cutoffs(
            logits.to(cuda), opts["temperature"], opts.get("top_k", 0), opts.get("top_p", 1.0)
        )
        t32 = sampling.float32_temperature(opts["temperature"])
        k_tok = kernels.sample_tokens(logits.to(cuda), noise.to(cuda), cut, t32)
        assert torch.equal(k_tok.cpu(), sampling.sample_tokens(logits, noise, cut.cpu(), t32))
