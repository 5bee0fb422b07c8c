"""sample_ddtree_target_probs_gpu (the SGLang port's sampled verify): the Triton kernels equal the
reference bit for bit, the reference follows the rule by hand and in distribution (the target drawn
token by token), bad arguments raise ValueError naming them, and on CUDA the port's own sampler agrees."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.integrations.sglang import sample as S
from kdtree_engine.kernels import sglang_sample as K
from kdtree_engine.ref import sglang_sample as ref

from .port import port_triton

OUTS = ("accepted_indices", "accepted_token_ids", "accepted_lens", "next_tokens", "reject_indices",
        "reject_child_tokens", "reject_child_counts")  # fmt: skip


def random_trees(g: torch.Generator, bs: int, q: int, vocab: int, full: bool = False, repeats: bool = False):
    """(draft_tokens, parents, sizes) [bs, q], [bs, q], [bs] in the verify layout: parents[i] < i and
    distinct child tokens under each parent for the real slots (with `repeats`, a child repeats a
    sibling's token half the time); garbage in the padding slots."""
    tokens = torch.randint(0, vocab, (bs, q), generator=g)
    parents = torch.randint(-1, q, (bs, q), generator=g)
    sizes = torch.full((bs,), q) if full else torch.randint(1, q + 1, (bs,), generator=g)
    for b in range(bs):
        parents[b, 0] = -1
        for i in range(1, int(sizes[b])):
            parent = int(torch.randint(0, i, (1,), generator=g))
            taken = tokens[b, 1:i][parents[b, 1:i] == parent].tolist()
            free = [t for t in range(vocab) if t not in taken]
            if repeats and taken and float(torch.rand(1, generator=g)) < 0.5:
                free = taken
            parents[b, i] = parent
            tokens[b, i] = free[int(torch.randint(0, len(free), (1,), generator=g))]
    return tokens, parents, sizes


def random_probs(g: torch.Generator, tokens, parents, sizes, vocab: int) -> torch.Tensor:
    """[bs, q, V] float32 target rows that favour each node's children (so walks go deep), in five
    kinds: plain softmax, exact ties, all zero, children plus tiny (< 2^-40) rest, sprinkled zeros."""
    bs, q = tokens.shape
    logits = torch.randn(bs, q, vocab, generator=g) * 2
    for b in range(bs):
        for i in range(1, int(sizes[b])):
            logits[b, parents[b, i], tokens[b, i]] += 4.0
    kind = torch.multinomial(torch.tensor([10.0, 3, 2, 2, 3]), bs * q, True, generator=g).view(bs, q)
    probs = torch.softmax(logits, -1)
    probs = torch.where((kind == 1)[..., None], torch.softmax(torch.round(logits), -1), probs)
    probs = torch.where((kind == 2)[..., None], 0.0, probs)
    kids = torch.zeros(bs, q, vocab, dtype=torch.bool)
    for b in range(bs):
        for i in range(1, int(sizes[b])):
            kids[b, parents[b, i], tokens[b, i]] = True
    tiny = torch.where(kids, 0.6 * probs, 2.0**-41)
    probs = torch.where((kind == 3)[..., None], tiny, probs)
    zeros = torch.rand(bs, q, vocab, generator=g) < 0.4
    return torch.where((kind == 4)[..., None] & zeros, 0.0, probs).float()


def random_uniforms(g: torch.Generator, bs: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    u, u_final = torch.rand(bs, q, generator=g), torch.rand(bs, generator=g)
    u[torch.rand(bs, q, generator=g) < 0.1] = 0.0  # the smallest uniform, including under the root
    u_final[torch.rand(bs, generator=g) < 0.2] = 0.0
    return u, u_final


def out_buffers(max_bs: int, cols: int, device="cpu") -> dict:
    """The worker's output buffers, pre-filled with a sentinel so that untouched entries show."""
    two_d = ("accepted_indices", "accepted_token_ids", "reject_child_tokens")
    return {k: torch.full((max_bs, cols) if k in two_d else (max_bs,), 77, dtype=torch.int64, device=device)
            for k in OUTS}  # fmt: skip


def views(bufs: dict, bs: int, q: int) -> dict:
    return {k: (v[:bs, :q] if v.dim() == 2 else v[:bs]) for k, v in bufs.items()}


def check_equal(got: dict, want: ref.SampleResult) -> None:
    for name in OUTS:
        assert torch.equal(got[name].cpu(), getattr(want, name)), name


# (bs, q, V, block, extra rows, extra columns, probs dtype, sizes given)
CASES = [
    (1, 1, 16, 16, 0, 0, torch.float32, True),
    (1, 2, 20, 16, 1, 0, torch.float32, True),
    (6, 7, 50, 16, 2, 3, torch.float32, True),
    (4, 12, 64, 16, 0, 1, torch.float32, False),
    (6, 5, 33, 32, 0, 0, torch.float32, True),
    (4, 9, 17, 16, 1, 0, torch.bfloat16, True),
    (4, 6, 23, 16, 0, 2, torch.float64, True),
    (1, 3, 2, 16, 0, 0, torch.float32, False),  # every token a child of the root
    (4, 4, 5, 16, 0, 0, torch.float16, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:4]) + f"-{str(c[6])[6:]}")
def test_kernels_equal_reference(case, device):
    bs, q, vocab, block, extra_rows, extra_cols, dtype, with_sizes = case
    g = torch.Generator().manual_seed(sum(case[:6]))
    tokens, parents, sizes = random_trees(g, bs, q, vocab, full=not with_sizes)
    probs = random_probs(g, tokens, parents, sizes, vocab).to(dtype)
    if with_sizes:  # sizes out of [1, q] are clamped into it, as in the port
        sizes = torch.where(sizes == 1, 0, torch.where(sizes == q, q + 3, sizes))
    for _ in range(2):  # two draws of the uniforms on the same trees
        u, u_final = random_uniforms(g, bs, q)
        want = ref.sample_path(probs, tokens, parents, sizes, u, u_final)
        bufs = out_buffers(bs + extra_rows, q + extra_cols, device)
        got = views(bufs, bs, q)
        uniforms = torch.rand(bs + extra_rows, q + extra_cols, generator=g)
        uniforms[:bs, :q] = u
        d_sizes = sizes.to(device) if with_sizes else None
        K.sample_into(probs.to(device), tokens.to(device), parents.to(device), d_sizes,
                      uniforms.to(device)[:bs, :q], u_final.to(device), **got, block=block)  # fmt: skip
        check_equal(got, want)
        for name, buf in bufs.items():  # nothing written outside [:bs, :q]
            rest = buf.cpu().clone()
            rest[(slice(0, bs), slice(0, q))[: rest.dim()]] = 77
            assert (rest == 77).all(), name


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_equal_reference_with_repeated_child_tokens(seed, device):
    """Not a tree the builder makes, but the port's contract covers it: a repeated child token counts
    once per slot in the walk and is masked once in the residual."""
    bs, q, vocab = 6, 8, 12
    g = torch.Generator().manual_seed(seed)
    tokens, parents, sizes = random_trees(g, bs, q, vocab, full=True, repeats=True)
    probs = torch.softmax(torch.randn(bs, q, vocab, generator=g), -1)  # children unfavoured: early rejects
    repeated = 0
    for _ in range(3):
        u, u_final = random_uniforms(g, bs, q)
        want = ref.sample_path(probs, tokens, parents, sizes, u, u_final)
        got = views(out_buffers(bs, q, device), bs, q)
        K.sample_into(probs.to(device), tokens.to(device), parents.to(device), sizes.to(device), u.to(device),
                      u_final.to(device), **got, block=16)  # fmt: skip
        check_equal(got, want)
        for b in range(bs):
            kids = want.reject_child_tokens[b, : want.reject_child_counts[b]].tolist()
            repeated += len(set(kids)) < len(kids)
    assert repeated >= 3  # the case under test happened


def test_public_function_draws_like_the_port_and_fills_the_buffers(device):
    bs, q, vocab, max_bs = 3, 6, 40, 5
    g = torch.Generator().manual_seed(7)
    tokens, parents, sizes = random_trees(g, bs, q, vocab)
    probs = random_probs(g, tokens, parents, sizes, vocab)
    bufs = out_buffers(max_bs, q + 2, device)
    uniforms = torch.zeros(max_bs, q + 2, device=device)
    u_final = torch.zeros(max_bs, device=device)
    big_sizes = torch.cat([sizes, torch.tensor([9, 9])]).to(device)
    seeded = torch.cuda.manual_seed if device.type == "cuda" else torch.manual_seed
    seeded(123)
    out = S.sample_ddtree_target_probs_gpu(
        target_probs=probs.to(device), draft_tokens=tokens.to(device), parents=parents.to(device),
        actual_tree_sizes=big_sizes, uniform_samples=uniforms, uniform_final=u_final, **bufs,
    )  # fmt: skip
    # The port's draws, in its order, on slices of the same shapes.
    seeded(123)
    u_port, final_port = torch.zeros_like(uniforms), torch.zeros_like(u_final)
    u_port[:bs, :q].uniform_()
    final_port[:bs].uniform_()
    assert torch.equal(uniforms, u_port) and torch.equal(u_final, final_port)
    want = ref.sample_path(probs, tokens, parents, sizes, uniforms[:bs, :q].cpu(), u_final[:bs].cpu())
    check_equal(views(bufs, bs, q), want)
    expected = (bufs["accepted_indices"][:bs, :q], bufs["accepted_token_ids"][:bs, :q],
                bufs["accepted_lens"][:bs], bufs["next_tokens"][:bs])  # fmt: skip
    assert len(out) == 4
    for o, e in zip(out, expected):
        assert o.data_ptr() == e.data_ptr() and o.shape == e.shape and torch.equal(o, e)


def by_hand_tree():
    """Root (token 8) -> node 1 (token 4), node 2 (token 6); node 1 -> node 3 (token 2). V = 10."""
    tokens = torch.tensor([[8, 4, 6, 2]])
    parents = torch.tensor([[-1, 0, 0, 1]])
    probs = torch.zeros(1, 4, 10)
    probs[0, 0, [4, 6, 1]] = torch.tensor([0.25, 0.5, 0.25])
    probs[0, 1, [2, 3]] = torch.tensor([0.6, 0.4])
    probs[0, 2, 9] = 1.0
    probs[0, 3, [0, 7]] = torch.tensor([0.5, 0.5])
    return tokens, parents, probs


@pytest.mark.parametrize(
    "u, u_final, path, nxt, children",
    [
        ([0.3, 0, 0, 0], 0.5, [0, 2], 9, []),  # 0.3 passes node 1's 0.25: node 2, a leaf
        ([0.8, 0, 0, 0], 0.0, [0], 1, [4, 6]),  # rejects at the root: the residual is token 1 alone
        ([0.1, 0.5, 0, 0], 0.0, [0, 1, 3], 0, []),  # node 1, then node 3 (0.5 < 0.6); u_final 0: token 0
        ([0.1, 0.5, 0, 0], 0.6, [0, 1, 3], 7, []),
        ([0.1, 0.7, 0, 0], 0.0, [0, 1], 3, [2]),  # rejects at node 1: token 3, never the child token 2
        ([0.75, 0, 0, 0], 0.0, [0], 1, [4, 6]),  # u equal to the children's sum rejects (strict <)
    ],
)
def test_reference_by_hand(u, u_final, path, nxt, children):
    tokens, parents, probs = by_hand_tree()
    u, u_final = torch.tensor([u]), torch.tensor([u_final])
    got = ref.sample_path(probs, tokens, parents, torch.tensor([4]), u, u_final)
    n = len(path)
    assert got.accepted_indices[0].tolist() == path + [-1] * (4 - n)
    assert got.accepted_token_ids[0].tolist() == tokens[0, path].tolist() + [0] * (4 - n)
    assert got.accepted_lens.tolist() == [n] and got.reject_indices.tolist() == [path[-1]]
    assert got.next_tokens.tolist() == [nxt]
    assert got.reject_child_counts.tolist() == [len(children)]
    assert got.reject_child_tokens[0].tolist() == children + [0] * (4 - len(children))


def test_residual_without_fixed_point_mass_takes_the_largest_non_child(device):
    """Children 0.25 + 0.25, the rest under 2^-40: a reject at the root leaves T = 0, and the fallback
    picks the largest non-child probability: token 5; with 5 zeroed, 3 (9 ties with it, 3 is smaller);
    with every non-child at 0, the smallest non-child id (2, not the port's 0, a child token)."""
    tokens, parents = torch.tensor([[0, 1, 0]] * 3), torch.tensor([[-1, 0, 0]] * 3)
    probs = torch.zeros(3, 3, 12)
    probs[:, 0, [0, 1, 3, 5, 9]] = torch.tensor([0.25, 0.25, 1e-13, 4e-13, 1e-13])
    probs[1, 0, 5] = 0.0
    probs[2, 0, 2:] = 0.0
    probs[:, 1:, 4] = 1.0
    u, u_final = torch.tensor([[0.9, 0.0, 0.0]] * 3), torch.tensor([0.5] * 3)
    want = ref.sample_path(probs, tokens, parents, torch.tensor([3] * 3), u, u_final)
    assert want.next_tokens.tolist() == [5, 3, 2] and want.reject_child_counts.tolist() == [2] * 3
    bufs = {k: v.to(device) for k, v in out_buffers(3, 3).items()}
    K.sample_into(probs.to(device), tokens.to(device), parents.to(device), None, u.to(device),
                  u_final.to(device), **bufs, block=16)  # fmt: skip
    check_equal(bufs, want)
    # Every token a child of the rejecting root: no non-child token exists, the draw is token 0.
    small = probs[:1, :, :2].clone()
    want = ref.sample_path(small, tokens[:1], parents[:1], torch.tensor([3]), u[:1], u_final[:1])
    assert want.next_tokens.tolist() == [0] and want.reject_indices.tolist() == [0]
    bufs = {k: v.to(device) for k, v in out_buffers(1, 3).items()}
    K.sample_into(small.to(device), tokens[:1].to(device), parents[:1].to(device), None, u[:1].to(device),
                  u_final[:1].to(device), **bufs, block=16)  # fmt: skip
    check_equal(bufs, want)


def enumerate_outcomes(tokens, parents, probs) -> dict:
    """{(reject node, next token): probability} of drawing from the target token by token along a
    tree: the path's child probabilities times the reject node's probability of a non-child token."""
    q = tokens.shape[1]
    out = {}
    for c in range(q):
        reach, node = 1.0, c
        while node > 0:
            reach *= float(probs[0, int(parents[0, node]), tokens[0, node]])
            node = int(parents[0, node])
        kids = {int(tokens[0, j]) for j in range(1, q) if int(parents[0, j]) == c}
        for x in range(probs.shape[-1]):
            out[(c, x)] = 0.0 if x in kids else reach * float(probs[0, c, x])
    return out


def g_test_p_value(counts: dict, expected: dict, n: int) -> float:
    """p-value of the G-test of the observed counts against the expected probabilities (cells under 5
    expected draws pooled); 0 if any draw falls in a cell of probability 0."""
    if any(expected[k] == 0.0 and c > 0 for k, c in counts.items()):
        return 0.0
    obs, exp, rare_o, rare_e = [], [], 0, 0.0
    for k, p in expected.items():
        if p * n < 5:
            rare_o, rare_e = rare_o + counts.get(k, 0), rare_e + p * n
        else:
            obs.append(counts.get(k, 0))
            exp.append(p * n)
    if rare_e > 0:
        obs.append(rare_o)
        exp.append(rare_e)
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = 2 * torch.where(o > 0, o * torch.log(o / e), 0.0).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), stat / 2))


def draw_outcomes(tokens, parents, probs, n: int, seed: int) -> dict:
    """n draws of the public function (the reference on the CPU) on one tree repeated n times."""
    q, vocab = tokens.shape[1], probs.shape[-1]
    bufs = out_buffers(n, q)
    torch.manual_seed(seed)
    S.sample_ddtree_target_probs_gpu(
        target_probs=probs.expand(n, q, vocab), draft_tokens=tokens.expand(n, q),
        parents=parents.expand(n, q),
        uniform_samples=torch.empty(n, q), uniform_final=torch.empty(n), **bufs,
    )  # fmt: skip
    # The accepted path is the root path of the reject node.
    root_paths = {}
    for c in range(q):
        chain = [c]
        while chain[-1] > 0:
            chain.append(int(parents[0, chain[-1]]))
        root_paths[c] = chain[::-1] + [-1] * (q - len(chain))
    want_paths = torch.tensor([root_paths[c] for c in range(q)])[bufs["reject_indices"]]
    assert torch.equal(bufs["accepted_indices"], want_paths)
    keys = bufs["reject_indices"] * vocab + bufs["next_tokens"]
    hist = torch.bincount(keys, minlength=q * vocab).tolist()
    return {(k // vocab, k % vocab): c for k, c in enumerate(hist) if c}


def distribution_case():
    """Root -> 1 (token 3), 2 (token 5), 3 (token 7); 1 -> 4 (token 2), 5 (token 3); 4 -> 6 (token 9);
    V = 10, rows favouring the children."""
    tokens = torch.tensor([[0, 3, 5, 7, 2, 3, 9]])
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 4]])
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 7, 10, generator=g) * 0.7
    for j in range(1, 7):
        logits[0, parents[0, j], tokens[0, j]] += 1.2
    return tokens, parents, torch.softmax(logits, -1)


def test_distribution_is_the_target_token_by_token(monkeypatch):
    tokens, parents, probs = distribution_case()
    expected = enumerate_outcomes(tokens, parents, probs)
    assert abs(sum(expected.values()) - 1.0) < 1e-5
    n = 20000
    assert g_test_p_value(draw_outcomes(tokens, parents, probs, n, seed=5), expected, n) > 1e-5
    # The same test rejects a sampler whose residual keeps the child tokens.
    residual = ref._residual
    monkeypatch.setattr(ref, "_residual", lambda row, kids, counts, u: residual(row, kids, 0 * counts, u))
    assert g_test_p_value(draw_outcomes(tokens, parents, probs, n, seed=5), expected, n) < 1e-5


def good_args(bs=2, q=3, vocab=8) -> dict:
    i64 = torch.int64
    return dict(
        target_probs=torch.full((bs, q, vocab), 1.0 / vocab), draft_tokens=torch.zeros(bs, q, dtype=i64),
        parents=torch.tensor([[-1, 0, 0]] * bs), actual_tree_sizes=torch.full((bs,), q),
        uniform_samples=torch.empty(bs, q), uniform_final=torch.empty(bs),
        **{k: v[:bs] for k, v in out_buffers(bs, q).items()},
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, bad",
    [
        ("target_probs", torch.zeros(2, 3)),
        ("target_probs", torch.zeros(2, 3, 8, dtype=torch.int64)),
        ("target_probs", torch.zeros(2, 0, 8)),
        ("target_probs", torch.zeros(2, 3, 0)),
        ("draft_tokens", torch.zeros(2, 4, dtype=torch.int64)),
        ("draft_tokens", torch.zeros(2, 3)),
        ("parents", torch.zeros(2, 3, dtype=torch.bool)),
        ("parents", torch.zeros(3, 2, dtype=torch.int64).t()),
        ("actual_tree_sizes", torch.zeros(1, dtype=torch.int64)),
        ("actual_tree_sizes", torch.zeros(2, 1, dtype=torch.int64)),
        ("uniform_samples", torch.zeros(2, 3, dtype=torch.float64)),
        ("uniform_samples", torch.zeros(2, 2)),
        ("uniform_final", torch.zeros(1)),
        ("accepted_indices", torch.zeros(2, 2, dtype=torch.int64)),
        ("accepted_token_ids", torch.zeros(2, 3, dtype=torch.int32)),
        ("accepted_lens", torch.zeros(2, 1, dtype=torch.int64)),
        ("next_tokens", torch.zeros(2, dtype=torch.int32)),
        ("reject_indices", "not a tensor"),
        ("reject_child_tokens", torch.zeros(1, 3, dtype=torch.int64)),
        ("reject_child_counts", torch.zeros(2, device="meta", dtype=torch.int64)),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(name, bad):
    args = good_args()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        S.sample_ddtree_target_probs_gpu(**args)


def test_good_arguments_pass_and_huge_vocab_is_refused():
    S.sample_ddtree_target_probs_gpu(**good_args())
    args = good_args()
    args["target_probs"] = torch.zeros(2, 3, 1).expand(2, 3, ref.MAX_VOCAB + 1)
    with pytest.raises(ValueError, match="target_probs"):
        S.sample_ddtree_target_probs_gpu(**args)


def test_empty_batch_returns_empty_views():
    args = good_args(bs=2)
    for k in ("target_probs", "draft_tokens", "parents"):
        args[k] = args[k][:0]
    out = S.sample_ddtree_target_probs_gpu(**args)
    assert [tuple(o.shape) for o in out] == [(0, 3), (0, 3), (0,), (0,)]


def gpu_batch(seed: int, bs: int, q: int, vocab: int, dev: torch.device):
    """A large batch quickly: random parents < i and random tokens (repeats under a parent are rare and
    allowed), sizes in [1, q], rows that give each child an extra probability."""
    g = torch.Generator().manual_seed(seed)
    slot = torch.arange(q)
    parents = (torch.rand(bs, q, generator=g) * slot).long()
    parents[:, 0] = -1
    tokens = torch.randint(0, vocab, (bs, q), generator=g)
    sizes = torch.randint(1, q + 1, (bs,), generator=g)
    probs = torch.softmax(torch.randn(bs, q, vocab, generator=g) * 3, -1)
    real = (slot > 0) & (slot < sizes[:, None])
    b_idx = torch.arange(bs)[:, None].expand(bs, q)
    probs.index_put_((b_idx[real], parents[real], tokens[real]), torch.tensor(1.0), accumulate=True)
    probs /= probs.sum(-1, keepdim=True)
    return probs.to(dev), tokens.to(dev), parents.to(dev), sizes.to(dev)


def run_sampler(fn, seed: int, probs, tokens, parents, sizes) -> dict:
    """One call of `fn` (ours, or the port's Triton sampler) on fresh buffers after seeding CUDA."""
    bs, q = tokens.shape
    bufs = out_buffers(bs, q, probs.device)
    u, u_final = torch.empty(bs, q, device=probs.device), torch.empty(bs, device=probs.device)
    torch.cuda.manual_seed(seed)
    fn(target_probs=probs, draft_tokens=tokens, parents=parents, actual_tree_sizes=sizes,
       uniform_samples=u, uniform_final=u_final, **bufs)  # fmt: skip
    return dict(bufs, u=u, u_final=u_final)


@pytest.mark.gpu
def test_same_draws_as_the_port_sampler_on_cuda():
    """The port's Triton sampler with the same generator state: the same uniforms, and the same
    accepted paths and next tokens on all but (at most) one request in a thousand (a float32 sum in the
    port and our fixed point can disagree at a boundary)."""
    port_sampler = port_triton().sample_ddtree_target_probs_triton
    dev = torch.device("cuda")
    bs, q, vocab, rounds = 1024, 16, 3000, 4
    mismatches, hist = 0, torch.zeros(2, q + 1, dtype=torch.int64)
    for r in range(rounds):
        batch = gpu_batch(100 + r, bs, q, vocab, dev)
        port = run_sampler(port_sampler, r, *batch)
        ours = run_sampler(S.sample_ddtree_target_probs_gpu, r, *batch)
        assert torch.equal(port["u"], ours["u"]) and torch.equal(port["u_final"], ours["u_final"])
        same = (port["accepted_indices"] == ours["accepted_indices"]).all(1)
        same &= port["accepted_lens"] == ours["accepted_lens"]
        same &= port["next_tokens"] == ours["next_tokens"]
        mismatches += int((~same).sum())
        for i, res in enumerate((port, ours)):
            hist[i] += torch.bincount(res["accepted_lens"].cpu(), minlength=q + 1)
    assert mismatches <= rounds * bs // 1000, mismatches
    assert int((hist[0] - hist[1]).abs().sum()) <= 2 * mismatches  # the same distribution of lengths
    assert int(hist[0, 2:].sum()) > rounds * bs // 4  # the trees were walked, not rejected at the root
