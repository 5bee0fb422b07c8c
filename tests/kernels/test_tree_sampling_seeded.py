"""Seeded sampled accept (counter-based noise): the Triton kernel equals the reference exactly (ties,
several vocab tiles, top-k / top-p / temperature, B and N edges), the seeded path is the Gumbel-max rule
with the noise `ref.sampling.seeded_noise` materializes, the integer Gumbel is accurate, the draws follow
the target distribution (chi-square at alpha 1e-6), and bad seeds / offsets are refused."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from kdtree_engine import tree as T
from kdtree_engine.kernels import tree_sample as kernels
from kdtree_engine.ref import sampling
from kdtree_engine.ref import tree as ref


def setup(seed: int, b: int, depth: int, budget: int, vocab: int, scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    lp, ids = ref.logits_to_topk(torch.randn(b, depth, vocab, generator=g), max(1, min(budget, vocab)))
    tree = ref.build_tree(lp, ids, budget)
    logits = torch.round(torch.randn(b, budget + 1, vocab, generator=g) * scale).bfloat16()  # ties
    return tree, logits


def to(tree, device):
    parts = (getattr(tree, f).to(device) for f in ("tokens", "depths", "parents", "num_nodes"))
    return T.DraftTree(*parts, tree.max_depth)


def kernel_tokens(logits, opts, seeded, block=None):
    """The kernel's tokens with the public op's cutoffs, at a chosen vocab tile."""
    temp = opts["temperature"]
    cut = sampling.sampling_cutoffs(logits, temp, opts.get("top_k", 0), opts.get("top_p", 1.0))
    t32 = sampling.float32_temperature(temp)
    return kernels.sample_tokens(logits, seeded, cut, t32, block=block), (cut, t32)


# (B, budget, V, vocab tile or None, logit scale, options): edges of B and N, one tile and many tiles,
# bf16 ties, a sharp distribution (tiles skipped), every filter.
CASES = [
    (3, 8, 40, None, 4.0, dict(temperature=1.0)),
    (1, 0, 1, None, 4.0, dict(temperature=0.6, top_k=5)),
    (2, 3, 300, 64, 4.0, dict(temperature=1.4, top_p=0.7)),
    (4, 1, 129, 32, 4.0, dict(temperature=0.8, top_k=10, top_p=0.5)),
    (2, 5, 77, None, 4.0, dict(temperature=3.0, top_k=1)),
    (1, 4, 500, 64, 8.0, dict(temperature=0.05)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-n{c[1] + 1}-V{c[2]}-tile{c[3]}")
def test_seeded_kernel_equals_reference(case, device):
    b, budget, vocab, block, scale, opts = case
    tree, logits = setup(vocab + budget, b, 3, budget, vocab, scale)
    seeded = sampling.Seeded(seed=2**63 + vocab, offset=budget)
    got, got_tok = T.accept_sampled(
        to(tree, device), logits.to(device), seed=seeded.seed, offset=seeded.offset, impl="triton", **opts
    )
    want, want_tok = T.accept_sampled(
        tree, logits, seed=seeded.seed, offset=seeded.offset, impl="ref", **opts
    )
    assert torch.equal(got_tok.cpu(), want_tok)
    for f in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), f
    # the seeded rule is Gumbel-max with exactly the noise seeded_noise materializes
    noise = sampling.seeded_noise(b, budget + 1, vocab, seeded)
    _, explicit = T.accept_sampled(tree, logits, noise=noise, impl="ref", **opts)
    assert torch.equal(explicit, want_tok)
    if block is not None:  # several vocab tiles in the kernel
        tok, _ = kernel_tokens(logits.to(device), opts, seeded, block)
        assert torch.equal(tok.cpu(), want_tok)


def test_ties_go_to_the_smaller_id(device):
    """Score ties: (a) logits so large that x / T + g rounds to x, spread over tiles (the tile skip
    must keep the earlier tile); (b) two tokens whose seeded noise is equal, alone above the top-k cut."""
    vocab = 4096
    x = torch.zeros(1, 1, vocab)
    x[0, 0, [700, 1500, 3000]] = 2.0**30
    seeded = sampling.Seeded(7, 3)
    for block in (64, 1024):
        tok, (cut, t32) = kernel_tokens(x.to(device), dict(temperature=1.0), seeded, block)
        assert tok.item() == 700 == sampling.sample_tokens(x, seeded, cut, t32).item()
    g = sampling.seeded_noise(1, 1, vocab, seeded)[0, 0]
    order = torch.argsort(g, stable=True)
    same = (g[order[1:]] == g[order[:-1]]).nonzero()
    assert len(same), "no equal noise pair in this row: pick another seed"
    pair = sorted(order[same[0, 0] : same[0, 0] + 2].tolist())
    x = torch.zeros(1, 1, vocab)
    x[0, 0, pair] = 5.0
    tok, (cut, t32) = kernel_tokens(x.to(device), dict(temperature=1.0, top_k=2), seeded, 512)
    assert tok.item() == pair[0] == sampling.sample_tokens(x, seeded, cut, t32).item()


def test_same_seed_and_offset_repeat_and_a_new_offset_changes():
    tree, logits = setup(3, 4, 3, 15, 200, scale=0.5)
    draw = [
        T.accept_sampled(tree, logits, temperature=1.0, seed=s, offset=o, impl="ref")[1]
        for s, o in ((9, 0), (9, 0), (9, 1), (10, 0))
    ]
    assert torch.equal(draw[0], draw[1])
    assert (draw[0] != draw[2]).float().mean() > 0.5 and (draw[0] != draw[3]).float().mean() > 0.5


@pytest.mark.parametrize("seed", [0, 9, 2**32 - 1, 2**32, 2**63 + 17, 2**64 - 1])
def test_the_key_table_holds_each_offsets_stream_keys(seed):
    """stream_key_table (every offset at once, on int64 tensors) = stream_keys offset by offset, bit-cast
    to int32: both halves of the seed, the sign bit of each key, and an empty table."""
    table = sampling.stream_key_table(seed, 37)
    assert table.dtype == torch.int32 and table.shape == (37, 2)
    for offset in range(37):
        want = [k - (1 << 32) if k >= 1 << 31 else k for k in sampling.stream_keys(seed, offset)]
        assert table[offset].tolist() == want
    assert (table < 0).any() and (table > 0).any()
    assert sampling.stream_key_table(seed, 0).shape == (0, 2)


def test_integer_gumbel_is_accurate_and_bounded():
    top = 2**32 - 1
    edges = [0, 1, 2, 2**31 - 1, 2**31, top - 2**24 - 1, top - 2**24, top - 2**24 + 1, top - 1, top]
    g64 = torch.Generator().manual_seed(0)
    h = torch.cat(
        [
            torch.tensor(edges),
            torch.randint(0, 2**32, (200_000,), generator=g64),
            top - torch.randint(0, 2**27, (100_000,), generator=g64),  # u near 1: the tail series
        ]
    ).long()
    big_g = sampling.gumbel_fixed(h)
    assert int((2 * big_g + 1).abs().max()) < 2**24  # exact in float32
    g = sampling.gumbel_from_fixed(big_g).double()
    u, d = (h.double() + 0.5) / 2**32, (2**32 - h.double() - 0.5) / 2**32  # u and 1 - u, exact
    exact = -torch.log(torch.where(d < 0.5, -torch.log1p(-d), -torch.log(u)))
    err = (g - exact).abs()
    assert float(err.max()) < 2**-19 + 2**-20, f"worst {float(err.max()):.3g} at h={int(h[err.argmax()])}"
    assert float(g.max()) < sampling.GUMBEL_MAX and float(g.min()) > -3.2


def chi2_critical(df: int, z: float = 4.753) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.753 is the normal 1 - 1e-6 quantile."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def assert_fits(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Pearson chi-square at alpha 1e-6, cells expecting < 5 draws pooled; zero-probability cells must
    stay empty."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    zero = expected == 0
    assert int(counts[zero].sum()) == 0, f"{what}: draws outside the support"
    counts, expected = counts[~zero], expected[~zero]
    small = expected < 5
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat, df = float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1
    assert stat < chi2_critical(df), f"{what}: chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"


def target_probs(x: torch.Tensor, opts) -> torch.Tensor:
    temp = opts["temperature"]
    cut = sampling.sampling_cutoffs(x[None, None], temp, opts.get("top_k", 0), opts.get("top_p", 1.0))
    return torch.softmax((x.double() / temp).masked_fill(x < cut[0, 0], -math.inf), -1)


def offset_stream(x: torch.Tensor, opts, seed: int, offsets: int) -> torch.Tensor:
    """The token of request 0, node 0 for logits x [V] at offsets 0.., one row of noise per offset
    (the rule of sample_tokens, vectorized over offsets; checked against it on the first few)."""
    keys = torch.tensor([sampling.stream_keys(seed, o) for o in range(offsets)])  # [offsets, 2]
    r0, r1 = (sampling.mix32(sampling.mix32(keys[:, i])) for i in (0, 1))  # b = n = 0
    g = sampling.gumbel_from_fixed(sampling.gumbel_fixed(sampling.hash_bits(r0, r1, len(x))))
    one = x[None, None]
    cut = sampling.sampling_cutoffs(one, opts["temperature"], opts.get("top_k", 0), opts.get("top_p", 1.0))
    t32 = sampling.float32_temperature(opts["temperature"])
    seq = sampling.sample_tokens(one.expand(1, offsets, len(x)), g[None], cut.expand(1, offsets), t32)[0]
    for o in range(4):
        assert int(sampling.sample_tokens(one, sampling.Seeded(seed, o), cut, t32)) == int(seq[o])
    return seq


@pytest.mark.parametrize(
    "opts", [dict(temperature=1.0), dict(temperature=0.7, top_k=6), dict(temperature=1.3, top_p=0.8)]
)
def test_seeded_draws_follow_the_target_distribution(opts):
    """20000 draws of one logit row (400 requests x 50 nodes, one call): the marginal and the joint of
    neighbouring nodes and neighbouring requests; then one node over 3000 offsets, marginal and joint of
    consecutive offsets."""
    b, nodes, vocab = 400, 50, 8
    x = torch.linspace(-2.0, 1.5, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))]
    p = target_probs(x, opts)
    tree = ref.build_tree(torch.zeros(b, 1, 1), torch.zeros(b, 1, 1, dtype=torch.long), nodes - 1)
    tree = T.DraftTree(tree.tokens, tree.depths, tree.parents, tree.num_nodes, tree.max_depth)
    logits = x.expand(b, nodes, vocab)
    _, tok = T.accept_sampled(tree, logits, seed=12345, offset=6, impl="ref", **opts)
    assert_fits(torch.bincount(tok.flatten(), minlength=vocab), p, "marginal")
    joint = p[:, None] * p[None, :]
    assert_fits(
        torch.bincount((tok[:, :-1] * vocab + tok[:, 1:]).flatten(), minlength=vocab**2), joint, "nodes"
    )
    assert_fits(torch.bincount((tok[:-1] * vocab + tok[1:]).flatten(), minlength=vocab**2), joint, "requests")
    seq = offset_stream(x, opts, seed=5, offsets=3000)
    assert_fits(torch.bincount(seq, minlength=vocab), p, "offsets")
    assert_fits(torch.bincount(seq[:-1] * vocab + seq[1:], minlength=vocab**2), joint, "consecutive offsets")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=True), "seed"),
        (dict(seed=1, offset=-1), "offset"),
        (dict(seed=1, offset=2**64), "offset"),
        (dict(seed=1, offset=2.0), "offset"),
        (dict(offset=3), "offset"),
        (dict(seed=1, noise=torch.zeros(2, 7, 30)), "noise"),
        (dict(seed=1, generator=torch.Generator()), "generator"),
    ],
)
def test_bad_seed_arguments(kwargs, match):
    tree, logits = setup(1, 2, 3, 6, 30)
    with pytest.raises(ValueError, match=match):
        T.accept_sampled(tree, logits, temperature=1.0, impl="ref", **kwargs)


OPTIONS = [dict(temperature=1.0), dict(temperature=0.6, top_k=50), dict(temperature=0.8, top_p=0.9)]


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_seeded_kimi_vocab_gpu(b):
    tree, logits = setup(b, b, 15, 32, 163840)
    cuda = torch.device("cuda")
    for opts in OPTIONS:
        tok, (cut, t32) = kernel_tokens(logits.to(cuda), opts, sampling.Seeded(b, 11))
        assert torch.equal(tok.cpu(), sampling.sample_tokens(logits, sampling.Seeded(b, 11), cut.cpu(), t32))
        if "top_p" not in opts:  # top-p cutoffs are computed on each device
            got, got_tok = T.accept_sampled(to(tree, cuda), logits.to(cuda), seed=b, offset=11, **opts)
            want, want_tok = T.accept_sampled(tree, logits, seed=b, offset=11, impl="ref", **opts)
            assert torch.equal(got_tok.cpu(), want_tok) and torch.equal(got.accepted.cpu(), want.accepted)


@pytest.mark.gpu
def test_seeded_kimi_batch_memory_gpu():
    """B = 64, N = 33, V = 163840 (1.4 GB of float32 noise in the explicit mode): the seeded mode
    allocates no [B, N, V] tensor; rows of two requests equal the reference (row keys depend on (b, n)
    only, so a slice of the batch is checked on its own)."""
    cuda = torch.device("cuda")
    b, nodes, vocab = 64, 33, 163840
    g = torch.Generator(device=cuda).manual_seed(0)
    logits = (torch.randn(b, nodes, vocab, generator=g, device=cuda) * 3).bfloat16()
    tree = ref.build_tree(torch.zeros(b, 1, 1), torch.zeros(b, 1, 1, dtype=torch.long), nodes - 1)
    tree = to(tree, cuda)
    for opts in OPTIONS[:2]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _, tok = T.accept_sampled(tree, logits, seed=3, offset=5, **opts)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < 64 * 2**20
        cut = sampling.sampling_cutoffs(logits[:2].cpu(), opts["temperature"], opts.get("top_k", 0))
        t32 = sampling.float32_temperature(opts["temperature"])
        want = sampling.sample_tokens(logits[:2].cpu(), sampling.Seeded(3, 5), cut, t32)
        assert torch.equal(tok[:2].cpu(), want)


COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from kdtree_engine.kernels import tree_sample as K
sig = {"x_ptr": "*bf16", "cut_ptr": "*fp32", "out_ptr": "*i64", "recip_ptr": "*i64", "log_ptr": "*i64",
       "V": "i32", "N": "i32", "temperature": "fp32", "p0": "i32", "p1": "i32"}
src = triton.compiler.ASTSource(K._sample_seeded_kernel, sig, constexprs={"BLOCK": 2048, "NT": 80})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"])
"""


def test_seeded_kernel_compiles_for_sm90_without_approximations():
    """The interpreter never compiles; this builds the kernel for an H200 (sm_90) on the CPU with the
    ptxas shipped in the Triton wheel, and checks the float ops the exactness argument allows: a
    correctly rounded division, adds (an fma only where the product is by 2^-19, exact), conversions,
    compares; no approximate transcendental."""
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(kernels.__file__.rsplit(os.sep, 1)[0]))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        pytest.skip(f"offline sm_90 compile unavailable: {run.stderr.strip().splitlines()[-1:]}")
    ops = set(re.findall(r"^\s+(?:@%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", run.stdout, re.M))
    floats = {op for op in ops if re.search(r"\.f(32|64)\b", op) and not op.startswith(("ld", "st", "mov"))}
    allowed = r"(div\.rn|add|fma\.rn|max|min|selp|setp\.\w+|neg|abs)\.f(32|64)|cvt(\.\w+)+"
    assert "div.rn.f32" in floats and all(re.fullmatch(allowed, op) for op in floats), sorted(floats)
    fmas = [line for line in run.stdout.splitlines() if "fma." in line]
    assert all(", 0f36000000, " in line for line in fmas), fmas[:3]  # times 2^-19: exact, fused or not
    assert ".approx" not in run.stdout and "ex2" not in run.stdout and "lg2" not in run.stdout
