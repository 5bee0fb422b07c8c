"""Vocabulary top-k + log-softmax normalizer (kernels/tree_topk.py) and build_tree_from_logits on the
kernel path, on the CPU through the Triton interpreter; the CUDA runs are in test_tree_topk_gpu.py.

Exactness: the kernel's ids (ties: smaller id first) AND log-probs must be bit-identical (torch.equal)
to ref.tree.logits_to_topk, and its trees identical to the reference's. The normalizer itself is
checked for accuracy against a float64 logsumexp, its float32 fused multiply-add emulation against
exact rational arithmetic, and the kernels' sm_90 code for the float operations the exactness
argument allows.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kdtree_engine import tree as T
from kdtree_engine.kernels import tree_topk
from kdtree_engine.ref import tree as ref

FIELDS = ("tokens", "depths", "parents", "num_nodes")


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


def check_topk(x: torch.Tensor, k: int, device, **knobs) -> None:
    lp, ids = tree_topk.logits_topk(x.to(device), k, **knobs)
    want_lp, want_ids = ref.logits_to_topk(x, k, block=knobs.get("block", ref.NORM_BLOCK))
    assert torch.equal(ids.cpu(), want_ids), f"ids differ at {(ids.cpu() != want_ids).nonzero()[:1].tolist()}"
    assert torch.equal(lp.cpu(), want_lp), f"log-probs differ by {(lp.cpu() - want_lp).abs().max().item()}"


CPU_CASES = [  # (b, depth, vocab, k, kind, knobs)
    (2, 2, 1000, 8, "smooth", {}),  # one block
    (1, 3, 1000, 16, "bf16", {"block": 256}),  # ties across 4 blocks
    (1, 2, 37, 37, "smooth", {"block": 16, "group": 16}),  # k = V; V not a multiple of the group or block
    (1, 2, 300, 8, "flat", {"block": 64}),  # every logit ties, 5 blocks: exact path
    (1, 2, 3000, 16, "bf16", {"max_groups": 4}),  # forced exact path, 2 blocks
    (1, 1, 100, 60, "signed_zero", {}),  # -0.0 ties with +0.0
    (1, 2, 500, 5, "bf16", {"group": 16, "max_groups": 8}),
    (1, 2, 5000, 16, "bf16", {"block": 1024, "super_group": 128}),  # 5 blocks, V not a multiple
    (1, 2, 2000, 8, "half", {}),  # fp16: keys shifted by 13
    (1, 1, 64, 64, "bf16", {"block": 16, "group": 16}),  # k = V with ties, k > groups and super groups
    (1, 3, 3000, 16, "bf16", {"max_compact": 16}),  # more logits >= T0 than KC: exact path
    (1, 2, 1000, 8, "smooth", {"super_group": 8, "select_warps": 2, "block": 128}),  # S = G
    (2, 2, 1000, 8, "smooth", {"group": 16, "block": 256, "select_maxnreg": 64, "partial_warps": 2}),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c[:5])))
def test_topk_matches_reference_bit_for_bit(case, device):
    b, depth, vocab, k, kind, knobs = case
    check_topk(make_logits(vocab + k, b, depth, vocab, kind), k, device, **knobs)


def plateau_logits(kind: str, seed: int, b: int, depth: int, vocab: int, k: int) -> torch.Tensor:
    """Adversarial-but-legal rows for the select (float32; cast by the caller), most of which overflow
    its fast path and take the exact path:
    all_equal: one value everywhere; all_but_three: a plateau with three larger entries;
    straddle: k // 2 entries above a plateau whose ties cross the k-th place, the rest below it;
    few_values: four values, each repeated about V / 4 times (k above the number of distinct values);
    signed_zero: -0.0 and +0.0 mixed, a few +-1; coarse: round(randn), massive exact ties;
    crowded: sorted descending (each row shifted), so the top logits fill the first groups and super
    groups (few ties in float32: the exact path's radix select runs all its digit passes)."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, depth, vocab)

    def spots(m: int) -> torch.Tensor:  # m distinct random ids per row
        return torch.rand(shape, generator=g).topk(min(m, vocab), dim=-1).indices

    def values(v: list[float], at: torch.Tensor) -> torch.Tensor:
        return torch.tensor(v)[: at.shape[-1]].expand(at.shape)

    if kind == "all_equal":
        return torch.full(shape, -1.25)
    if kind == "all_but_three":
        at = spots(3)
        return torch.full(shape, 0.75).scatter(-1, at, values([4.0, 2.5, 1.0], at))
    if kind == "straddle":
        x = torch.where(torch.rand(shape, generator=g) < 0.5, 0.5, -torch.rand(shape, generator=g) - 1)
        at = spots(k // 2)
        return x.scatter(-1, at, 1.0 + torch.rand(at.shape, generator=g).round())
    if kind == "few_values":
        return torch.randint(0, 4, shape, generator=g).float() - 1.5
    if kind == "signed_zero":
        x = torch.where(torch.rand(shape, generator=g) < 0.5, -0.0, 0.0)
        at = spots(4)
        return x.scatter(-1, at, values([1.0, -1.0, 1.0, -1.0], at))
    if kind == "coarse":
        return torch.round(torch.randn(shape, generator=g))
    if kind == "crowded":
        row = torch.randn(vocab, generator=g).sort(descending=True).values
        return row + torch.randn(b, depth, 1, generator=g)
    raise ValueError(kind)


PLATEAU_CASES = [  # (b, depth, vocab, budget, kind, dtype)
    (1, 2, 2000, 16, "all_equal", torch.bfloat16),
    (1, 1, 1000, 8, "all_equal", torch.float32),
    (1, 2, 3000, 32, "all_but_three", torch.bfloat16),
    (1, 1, 2000, 8, "all_but_three", torch.float16),
    (1, 2, 2000, 16, "straddle", torch.float32),
    (1, 1, 1000, 31, "straddle", torch.bfloat16),
    (1, 2, 1000, 16, "few_values", torch.bfloat16),  # k = 16 > 4 distinct values
    (1, 1, 3000, 8, "few_values", torch.float16),
    (1, 2, 1000, 12, "signed_zero", torch.float32),
    (1, 1, 2000, 8, "signed_zero", torch.bfloat16),
    (1, 2, 3000, 32, "coarse", torch.bfloat16),
    (1, 1, 2000, 16, "crowded", torch.float32),
    (1, 1, 1000, 8, "crowded", torch.float16),
    (1, 1, 2000, 16, "crowded", torch.bfloat16),
    (1, 1, 3000, 64, "crowded", torch.float32),  # k * S / G and k * G items: several tiles per level
    (1, 1, 3000, 100, "straddle", torch.bfloat16),
    (1, 1, 64, 64, "all_equal", torch.bfloat16),  # k = V
    (1, 2, 37, 37, "few_values", torch.float32),  # k = V, V not a multiple of the group
    (1, 1, 5, 16, "straddle", torch.float16),  # V < budget: k = V
]


@pytest.mark.parametrize("case", PLATEAU_CASES, ids=lambda c: "-".join(map(str, c[:5])) + f"-{c[5]}"[6:])
def test_plateaus_match_reference_bit_for_bit(case, device):
    """Plateaus and heavy ties with the default knobs (the select picks its path), again with every row
    sent to the exact path (max_groups=1), and the trees built from the logits on the kernel path."""
    b, depth, vocab, budget, kind, dtype = case
    k = min(budget, vocab)
    x = plateau_logits(kind, vocab + budget, b, depth, vocab, k).to(dtype)
    check_topk(x, k, device)
    check_topk(x, k, device, max_groups=1)
    got = T.build_tree_from_logits(x.to(device), budget, impl="triton")
    want = T.build_tree_from_logits(x, budget, impl="ref")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@triton.jit
def _mark_exact(x_ptr, gmax_ptr, sk_s, ok_s, sidx, top, glist, keys_row, row, V, NG, k, lse, lp_out, ids_out,
                G: tl.constexpr, RS: tl.constexpr, KP: tl.constexpr, HT: tl.constexpr, SHIFT: tl.constexpr,
                NPASS: tl.constexpr, DB: tl.constexpr):  # fmt: skip
    """Stands in for tree_topk._exact_select: writes -7 as the row's first id."""
    tl.store(ids_out + row * k, -7)


def test_plateaus_take_the_exact_path(monkeypatch, device):
    """The plateau inputs above do overflow the fast path (default knobs): a stand-in for _exact_select
    that only marks its row sees every row of them. Interpreter only (it swaps a global of the kernel)."""
    if device.type != "cpu":
        pytest.skip("swaps a jit global: Triton interpreter only")
    monkeypatch.setattr(tree_topk, "_exact_select", _mark_exact)
    for kind in ("all_equal", "all_but_three", "straddle", "few_values", "signed_zero", "crowded"):
        x = plateau_logits(kind, 0, 1, 2, 2000, 16).bfloat16()
        _, ids = tree_topk.logits_topk(x, 16)
        assert bool((ids[..., 0] == -7).all()), kind


def grid_logits(seed: int):
    """A tie-heavy small-vocabulary case: logits on a grid of 0.5 or 0.25, V in 1..8, any float dtype."""
    rnd = random.Random(seed)
    b, depth, vocab, budget = rnd.randint(1, 3), rnd.randint(1, 8), rnd.randint(1, 8), rnd.randint(1, 32)
    step = rnd.choice([0.5, 0.25])
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(b, depth, vocab, generator=g) * 2 / step) * step
    return x.to(rnd.choice([torch.float32, torch.bfloat16, torch.float16])), budget


@pytest.mark.parametrize("seed", range(12))
def test_tie_heavy_small_vocab_trees_match_reference(seed, device):
    x, budget = grid_logits(seed)
    k = min(budget, x.shape[-1])
    lp, ids = tree_topk.logits_topk(x.to(device), k)
    want_lp, want_ids = ref.logits_to_topk(x, k)
    assert torch.equal(lp.cpu(), want_lp) and torch.equal(ids.cpu(), want_ids)
    got = T.build_tree(lp, ids, budget, impl="triton")
    want = T.build_tree(want_lp, want_ids, budget, impl="ref")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@pytest.mark.parametrize("vocab", [1, 2, 3])
def test_build_from_logits_tiny_vocab(vocab, device):
    """The public op end to end (V = 3, L = 7, budget 16 is the shape where a float32 logsumexp summed
    in another order gave another tree on a GPU)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.round(torch.randn(2, 7, vocab, generator=g) * 4) / 2
    got = T.build_tree_from_logits(x.to(device), 16, impl="triton")
    want = T.build_tree_from_logits(x, 16, impl="ref")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_build_from_logits_matches_reference(budget, device):
    x = make_logits(budget, 2, 3, 200, "bf16")
    got = T.build_tree_from_logits(x.to(device), budget, impl="triton")
    want = T.build_tree_from_logits(x, budget, impl="ref")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f


def test_masked_logits(device):
    """-inf entries (masked tokens; accepted with validate=False), one block wholly masked."""
    x = make_logits(3, 1, 2, 300, "smooth")
    x[0, 0, ::2] = float("-inf")
    x[0, 1, :128] = float("-inf")
    check_topk(x, 8, device, block=64)
    tree = T.build_tree_from_logits(x.to(device), 8, impl="triton", validate=False)
    want = T.build_tree_from_logits(x, 8, impl="ref", validate=False)
    assert torch.equal(tree.parents.cpu(), want.parents) and torch.equal(tree.tokens.cpu(), want.tokens)


def masked_case(seed: int):
    """Random logits with a random -inf mask (tokens filtered out or forbidden), every row keeping at
    least one finite logit: (logits, budget, mask). Mask shares from a few percent to all but one
    token, so many rows hold fewer finite logits than budget; coarse values tie among the finite."""
    rnd = random.Random(seed)
    b, depth = rnd.randint(1, 3), rnd.randint(1, 5)
    vocab, budget = rnd.choice([3, 8, 37, 300, 2500]), rnd.choice([1, 5, 16, 40])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, depth, vocab, generator=g) * 3
    if rnd.random() < 0.5:
        x = torch.round(x)
    share = rnd.choice([0.05, 0.5, 0.9, 0.99, 1.0])
    mask = torch.rand(b, depth, vocab, generator=g) < share
    keep = torch.randint(0, vocab, (b, depth, 1), generator=g)
    mask.scatter_(-1, (keep + 1) % vocab, True).scatter_(-1, keep, False)  # one masked and one kept a row
    x = x.masked_fill(mask, float("-inf"))
    return x.to(rnd.choice([torch.float32, torch.bfloat16, torch.float16])), budget, mask


def check_masked(seed: int, device) -> None:
    """The kernel's top-k (ids and log-probs, -inf ones included) and tree equal the reference's."""
    x, budget, mask = masked_case(seed)
    k = min(budget, x.shape[-1])
    check_topk(x, k, device)
    check_topk(x, k, device, max_groups=1)  # the exact path
    got = T.build_tree_from_logits(x.to(device), budget, impl="triton")
    want = T.build_tree_from_logits(x, budget, impl="ref")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    for r in range(x.shape[0]):
        n = int(want.num_nodes[r])
        assert not bool(mask[r, want.depths[r, :n] - 1, want.tokens[r, :n]].any())


@pytest.mark.parametrize("seed", range(10))
def test_masked_logits_match_reference(seed, device):
    check_masked(seed, device)


def test_masked_rows_shorter_than_budget(device):
    """Rows with fewer finite logits than budget (one row with a single one), ties among the finite:
    the kernel equals the reference and the tree stops at the finite paths."""
    x = torch.full((2, 3, 50), float("-inf"))
    x[0, :, [4, 9, 30]] = torch.tensor([1.0, 1.0, 0.5])
    x[1, 0, 7] = 2.0
    x[1, 1:, :20] = 0.0  # 20 tied finite logits
    check_topk(x, 16, device)
    got = T.build_tree_from_logits(x.to(device), 16, impl="triton")
    want = T.build_tree_from_logits(x, 16, impl="ref")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    assert want.num_nodes.tolist() == [16, 16]
    assert want.tokens[0, :3].tolist() == [4, 9, 30]
    assert set(want.tokens[0].tolist()) == {4, 9, 30}
    assert want.tokens[1, :2].tolist() == [7, 0] and want.depths[1, :2].tolist() == [1, 2]
    small = T.build_tree_from_logits(x[:1].to(device), 50, impl="triton")
    assert small.num_nodes.tolist() == [3 + 9 + 27]  # every finite path, then the tree stops


@pytest.mark.gpu
@pytest.mark.parametrize("start", range(0, 400, 100))
def test_masked_logits_fuzz_gpu(start):
    for seed in range(start, start + 100):
        check_masked(seed, torch.device("cuda"))


@pytest.mark.gpu
def test_masked_kimi_vocab_gpu():
    """V = 163840 bf16 rows filtered as a sampler does (top 50 kept, then top 5; ties with the last
    are kept), a forbidden-token mask, and one token a row (a chain of L nodes, short of the budget):
    the kernel's top-k and tree equal the reference's (run on the CPU)."""
    cuda, budget = torch.device("cuda"), 32
    x = make_logits(7, 2, 8, 163840, "bf16").float()
    top50 = x.masked_fill(x < x.topk(50, dim=-1).values[..., -1:], float("-inf"))
    top5 = x.masked_fill(x < x.topk(5, dim=-1).values[..., -1:], float("-inf"))
    forbidden = x.clone()
    forbidden[..., ::3] = float("-inf")
    one = torch.full_like(x, float("-inf")).scatter(-1, x.argmax(-1, keepdim=True), 0.0)
    for masked in (top50, top5, forbidden, one):
        masked = masked.bfloat16()
        check_topk(masked, budget, cuda)
        got = T.build_tree_from_logits(masked.to(cuda), budget, impl="triton")
        want = T.build_tree_from_logits(masked, budget, impl="ref")
        for f in FIELDS:
            assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    assert want.num_nodes.tolist() == [8, 8]  # the last: one path of L = 8 nodes


def check_unvalidated_bad_logits(device) -> None:
    """validate=False with NaN, +inf and all -inf rows (fast and exact paths): the launches finish with
    an undefined tree of the right shapes (docs/tree.md), no error."""
    x = make_logits(5, 3, 4, 3000, "bf16").float()
    x[0, 1, 7] = float("nan")
    x[1, 0] = float("nan")
    x[1, 2, 100] = float("inf")
    x[2, 3] = float("-inf")
    for dtype, knobs in ((torch.float32, {}), (torch.bfloat16, {"max_groups": 1})):
        lp, ids = tree_topk.logits_topk(x.to(dtype).to(device), 16, **knobs)
        tree = T.build_tree(lp, ids, 16, impl="triton", validate=False)
        assert tree.tokens.shape == (3, 16) and tree.parents.shape == (3, 17)
        assert bool(((tree.num_nodes >= 0) & (tree.num_nodes <= 16)).all())
    tree = T.build_tree_from_logits(x.to(device), 16, impl="triton", validate=False)
    assert tree.tokens.shape == (3, 16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy casts of NaN
def test_unvalidated_bad_logits_finish(device):
    check_unvalidated_bad_logits(device)


@pytest.mark.gpu
def test_unvalidated_bad_logits_finish_gpu():
    check_unvalidated_bad_logits(torch.device("cuda"))
    torch.cuda.synchronize()  # an out-of-bounds access would surface here


def test_bad_block_is_a_value_error():
    with pytest.raises(ValueError, match="block"):
        tree_topk.logits_topk(torch.zeros(1, 1, 64), 2, block=48)
    with pytest.raises(ValueError, match="block"):
        ref.log_normalizer(torch.zeros(1, 64), block=8192)


def test_normalizer_accuracy():
    """Against a float64 logsumexp: within 2e-7 of max(1, |lse|) (float32 itself rounds to 6e-8)."""
    worst = 0.0
    for seed in range(60):
        rnd = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        vocab = rnd.choice([1, 2, 3, 7, 100, 2047, 2049, 5000, 40000])
        x = torch.randn(4, vocab, generator=g) * rnd.choice([0.1, 1.0, 3.0, 10.0, 30.0])
        x = x + rnd.uniform(-100, 100)
        if seed % 3 == 1:
            x = torch.round(x * 2) / 2
        if seed % 4 == 2:
            x = x.bfloat16().float()
        want = torch.logsumexp(x.double(), -1, keepdim=True)
        err = (ref.log_normalizer(x).double() - want).abs() / want.abs().clamp_min(1.0)
        worst = max(worst, err.max().item())
    assert worst <= 2e-7, worst
    d = -torch.rand(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float() * 44
    rel = (ref.exp_nonpositive(d).double() / torch.exp(d.double()) - 1).abs()
    assert bool((rel <= 1.6e-7 + 1.5e-8 * d.abs().double()).all())
    s = torch.cat([torch.tensor([2**40, 2**40 + 1, 3 * 2**40, 2**62]), torch.randint(2**40, 2**62, (200,))])
    want = torch.tensor(
        [float(np.log(Fraction(int(v), 2**40).__float__())) for v in s.tolist()], dtype=torch.float64
    )
    assert (ref.log_fixed(s) - want).abs().max().item() <= 1e-9
    assert ref.log_fixed(torch.tensor([2**40])).item() == 0.0  # the largest logit's log-prob is 0, never > 0


def correctly_rounded_fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(
        candidates, key=lambda y: (abs(Fraction(float(y)) - exact), int(np.array(y).view(np.int32)) & 1)
    )


def test_fma32_rounds_once():
    """ref.tree.fma32 against exact rationals, including sums a float64 rounding puts on a float32
    midpoint (where computing in float64 and rounding to float32 rounds twice and can err)."""
    rnd = random.Random(0)
    a, b, c = [], [], []
    for i in range(4000):
        if i % 2:
            a.append(rnd.uniform(-2, 2) * 2.0 ** rnd.randint(-30, 10))
            b.append(rnd.uniform(-2, 2) * 2.0 ** rnd.randint(-30, 10))
            c.append(rnd.uniform(-2, 2) * 2.0 ** rnd.randint(-30, 10))
        else:  # c + about half an ulp of c
            e = rnd.randint(1, 20)
            c.append((1.0 + rnd.randint(0, 2**23 - 1) * 2.0**-23) * rnd.choice([1, -1]))
            a.append(2.0**-e * (1 + rnd.randint(-4, 4) * 2.0**-23) * rnd.choice([1, -1]))
            b.append(2.0 ** (e - 24) * (1 + rnd.randint(-4, 4) * 2.0**-23))
    a, b, c = (np.array(v, dtype=np.float32) for v in (a, b, c))
    got = ref.fma32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
    want = np.array([correctly_rounded_fma(*t) for t in zip(a, b, c)], dtype=np.float32)
    assert np.array_equal(got, want)
    twice = (a.astype(np.float64) * b + c).astype(np.float32)
    assert not np.array_equal(twice, want)  # the cases do reach the double-rounding trap


COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from kdtree_engine.kernels import tree_topk as K
div = [["tt.divisibility", 16]]
head = {"x_ptr": "*bf16", "gmax_ptr": "*fp32", "smax_ptr": "*fp32", "bmax_ptr": "*fp32", "bsum_ptr": "*i64"}
sig = {**head, "V": "i32", "NG": "i32", "NS": "i32", "NB": "i32"}
c = {"CH": 2048, "G": 32, "S": 1024, "EMULATE": False}
attrs = {(i,): div for i in range(len(sig))}
src = triton.compiler.ASTSource(K._partials_kernel, sig, constexprs=c, attrs=attrs)
opts = {"num_warps": 1, "enable_fp_fusion": False}
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])
print("//==== select")
sig = {**head, "glist_ptr": "*i32", "keys_ptr": "*i64", "lp_out": "*fp32", "ids_out": "*i64",
       "V": "i32", "NG": "i32", "NS": "i32", "NB": "i32", "k": "i32"}
c = dict(G=32, RS=32, NGP=8192, NSP=256, NBP=128, MAXG=128, GW=128, KP=32, KC=256, KS=256, TG=32, TGM=1024,
         HT=1024, SHIFT=16, NPASS=3, DB=6, EMULATE=False)
src = triton.compiler.ASTSource(K._select_kernel, sig, constexprs=c)
opts = {"num_warps": 2, "enable_fp_fusion": False}
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])
"""


def float_ops(ptx: str) -> set[str]:
    ops = set(re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", ptx, re.M))
    return {op for op in ops if re.search(r"\.f(32|64)\b", op) and not op.startswith(("ld", "st", "mov"))}


def test_kernels_compile_for_sm90_with_exact_float_ops():
    """The interpreter never compiles; this builds both launches for sm_90 on the CPU with the
    ptxas shipped in the Triton wheel, as logits_topk launches them (fused multiply-add contraction
    off), and checks that every float operation is one the reference reproduces: explicitly rounded
    (.rn) adds, subtracts and multiplies, the explicit fma.rn.f32 of the exp polynomial, max,
    compares, selects and conversions; no approximate or flush-to-zero instruction, no division."""
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(os.path.dirname(tree_topk.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        pytest.skip(f"offline sm_90 compile unavailable: {run.stderr.strip().splitlines()[-1:]}")
    partials, select = run.stdout.split("//==== select")
    allowed = r"((add|sub|mul|fma)\.rn|max|selp|setp\.\w+|neg|abs)\.f(32|64)|cvt(\.\w+)+"
    for ptx in (partials, select):
        ops = float_ops(ptx)
        assert ops and all(re.fullmatch(allowed, op) for op in ops), sorted(ops)
        assert "fma.rn.f32" in ops and not any(op.startswith("fma.rn.f64") for op in ops)
        assert not re.search(r"\.(approx|ftz|full)\b|\b(ex2|lg2|rcp|div|sqrt)\.", ptx)
