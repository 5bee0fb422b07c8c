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


CPU_CASES = [  # (b, depth, vocab, k, kind, knobs)
    (2, 2, 1000, 8, "smooth", {}),
    (1, 3, 1000, 16, "bf16", {}),
    (1, 2, 37, 37, "smooth", {}),  # k = V, V not a multiple of the group
    (1, 2, 300, 8, "flat", {}),  # every logit ties: slow path
    (1, 2, 3000, 16, "bf16", {"max_groups": 4}),  # forced slow path
    (1, 1, 100, 60, "signed_zero", {}),  # -0.0 ties with +0.0
    (1, 2, 500, 5, "bf16", {"group": 16, "max_groups": 8}),
    (2, 2, 1000, 8, "smooth", {"variant": "compact"}),  # float32: unshifted keys
    (1, 3, 1000, 8, "bf16", {"variant": "compact"}),  # bf16: keys shifted by 16
    (1, 2, 1000, 8, "half", {"variant": "compact"}),  # fp16: keys shifted by 13
    (1, 3, 1000, 8, "bf16", {"variant": "compact", "max_compact": 16}),  # too many ties for KC
    (1, 2, 300, 8, "flat", {"variant": "compact"}),
    (1, 1, 100, 60, "signed_zero", {"variant": "compact"}),
    # default "thresh" select: several chunks, super groups and group-max tiles; V not a multiple of them
    (1, 2, 5000, 16, "bf16", {"chunk": 1024, "super_group": 128}),
    (1, 2, 2000, 8, "half", {}),  # fp16: keys shifted by 13
    (1, 1, 64, 64, "bf16", {}),  # k = V with ties, k > number of super groups
    (1, 3, 3000, 16, "bf16", {"max_compact": 16}),  # more logits >= T0 than KC: bisection path
    (1, 2, 1000, 8, "smooth", {"super_group": 8, "select_warps": 2, "partial_warps": 2}),  # S = G
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c[:5])))
def test_topk_matches_reference(case, device):
    b, depth, vocab, k, kind, knobs = case
    check_topk(make_logits(vocab + k, b, depth, vocab, kind), k, device, **knobs)


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
    """The "compact" and "thresh" top-k variants at the Kimi vocab (B = 64, L = 15)."""
    x = make_logits(7, 64, 15, 163840, kind).bfloat16()
    want = ref.logits_to_topk(x, 64)
    for budget in (8, 32, 64):
        for variant in ("compact", "thresh"):
            check_topk(x, budget, torch.device("cuda"), want, variant=variant)


def test_unknown_variant_is_a_value_error():
    with pytest.raises(ValueError, match="variant"):
        tree_topk.logits_topk(torch.zeros(1, 1, 4), 2, variant="radix")
