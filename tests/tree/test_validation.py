"""Bad input at the public boundary gives a ValueError naming the argument."""

import itertools
import os
import warnings

import numpy as np
import pytest
import torch

from kdtree_engine.tree import accept_greedy, build_tree, build_tree_from_logits, compile_tree


def good(b=2, depth=3, k=4):
    lp = torch.sort(torch.randn(b, depth, k), dim=-1, descending=True).values
    return lp, torch.arange(b * depth * k).reshape(b, depth, k)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda lp, ids: (lp[0, 0], ids), "top_logprobs"),  # rank 1
        (lambda lp, ids: (lp, ids[:, :, :2]), "top_ids"),  # shape mismatch
        (lambda lp, ids: (lp.long(), ids), "top_logprobs"),  # not float
        (lambda lp, ids: (lp, ids.float()), "top_ids"),  # not int
        (lambda lp, ids: (lp.index_fill(2, torch.tensor([1]), float("nan")), ids), "top_logprobs"),
        (lambda lp, ids: (lp.index_fill(2, torch.tensor([0]), float("inf")), ids), "top_logprobs"),
        (lambda lp, ids: (lp.flip(-1), ids), "top_logprobs"),  # ascending rows
        (lambda lp, ids: (lp, ids - 5), "top_ids"),  # negative ids
        (lambda lp, ids: (lp[:, :, :0], ids[:, :, :0]), "top_logprobs"),  # K = 0
        (lambda lp, ids: ([[1.0]], ids), "top_logprobs"),  # not a tensor
    ],
)
def test_build_tree_rejects(mutate, match):
    lp, ids = mutate(*good())
    with pytest.raises(ValueError, match=match):
        build_tree(lp, ids, 4)


def test_build_tree_rejects_budget_and_vocab():
    lp, ids = good()
    for budget in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="budget"):
            build_tree(lp, ids, budget)
    with pytest.raises(ValueError, match="top_ids"):
        build_tree(lp, ids, 4, vocab_size=10)


def test_build_tree_rejects_mixed_devices():
    lp, ids = good()
    meta_ids = ids.to("meta")
    with pytest.raises(ValueError, match="device"):
        build_tree(lp, meta_ids, 4)


def test_numpy_and_rank2_inputs_are_accepted():
    lp, ids = good(b=1)
    a = build_tree(lp.numpy(), ids.numpy(), 5)
    b = build_tree(lp[0], ids[0], 5)
    assert torch.equal(a.parents, b.parents) and torch.equal(a.tokens, b.tokens)
    assert isinstance(np.asarray(a.tokens), np.ndarray)


def test_build_from_logits_rejects():
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.randn(2, 3, 4, 5), 4)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.tensor([[[1.0, float("nan")]]]), 4)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.randint(0, 3, (1, 2, 3)), 4)
    with pytest.raises(ValueError, match="budget"):
        build_tree_from_logits(torch.randn(1, 2, 3), -2)
    with pytest.raises(ValueError, match="impl"):
        build_tree_from_logits(torch.randn(1, 2, 3), 2, impl="cuda")
    with pytest.raises(ValueError, match="draft_logits"):  # V above 2^22: the normalizer's int64 sum
        build_tree_from_logits(torch.zeros(1, 1, 2**22 + 1, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="draft_logits"):
        build_tree_from_logits(torch.zeros(1, 1, 0), 2)


def test_compile_and_accept_reject():
    lp, ids = good()
    tree = build_tree(lp, ids, 5)
    roots, starts = torch.tensor([1, 2]), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="tree"):
        compile_tree("tree", roots, starts)
    with pytest.raises(ValueError, match="root_tokens"):
        compile_tree(tree, torch.tensor([1]), starts)
    with pytest.raises(ValueError, match="start_positions"):
        compile_tree(tree, roots, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="start_positions"):
        compile_tree(tree, roots, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="target_tokens"):
        accept_greedy(tree, torch.zeros(2, 5, dtype=torch.long))  # needs N = 6 columns
    with pytest.raises(ValueError, match="target_tokens"):
        accept_greedy(tree, torch.zeros(2, 6))


# These tests build CPU inputs: the Triton path takes them only in the interpreter (CI, CPU machines); on a
# CUDA machine the kernels need CUDA tensors (a ValueError naming impl), and the gpu-marked tests below
# cover the validation on CUDA.
ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = [
    "ref",
    pytest.param("triton", marks=pytest.mark.skipif(not ON_CPU, reason="CPU inputs, interpreter only")),
]
INF = float("inf")


def logits_with(value: float, at: tuple[int, int, int], shape=(2, 3, 5)) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x[at] = value
    return x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nan_logits_are_named_with_their_index(impl, dtype):
    x = logits_with(float("nan"), (1, 2, 3)).to(dtype)
    x[0, 1, 4] = INF  # a later +inf: the NaN is reported first
    with pytest.raises(ValueError, match=r"draft_logits: contains NaN at \[1, 2, 3\]"):
        build_tree_from_logits(x, 4, impl=impl)
    with pytest.raises(ValueError, match=r"draft_logits: contains NaN at \[0, 2, 3\]"):
        build_tree_from_logits(x[1], 4, impl=impl)  # [L, V] is batch 1


@pytest.mark.parametrize("impl", IMPLS)
def test_inf_logits_and_empty_rows_are_refused(impl):
    with pytest.raises(ValueError, match=r"draft_logits: contains \+inf at \[0, 1, 2\]"):
        build_tree_from_logits(logits_with(INF, (0, 1, 2)), 4, impl=impl)
    wide = logits_with(0.0, (0, 0, 0)).double()
    wide[1, 0, 0] = 1e300  # finite in float64, +inf as the float32 the ops compute in
    with pytest.raises(ValueError, match=r"draft_logits: contains \+inf at \[1, 0, 0\]"):
        build_tree_from_logits(wide, 4, impl=impl)
    x = logits_with(0.0, (0, 0, 0))
    x[1, 2] = -INF
    with pytest.raises(ValueError, match=r"draft_logits: row \[1, 2\] has no finite logit"):
        build_tree_from_logits(x, 4, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_logits_are_accepted_when_validating(impl):
    x = logits_with(-INF, (0, 0, 1))
    x[1, :, :4] = -INF  # one finite logit per row of request 1: a chain of depth 3
    tree = build_tree_from_logits(x, 6, impl=impl)
    assert tree.num_nodes.tolist() == [6, 3]
    assert tree.tokens[1, :3].tolist() == [4, 4, 4] and tree.parents[1, :4].tolist() == [-1, 0, 1, 2]


@pytest.mark.skipif(not ON_CPU, reason="CPU inputs to the Triton path: interpreter only")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy casts of NaN
def test_nan_logits_without_validation():
    """validate=False: the reference reads the logits on the host and still refuses them; the kernel
    path checks nothing (no host sync) and returns an undefined tree of the right shapes, no crash."""
    x = logits_with(float("nan"), (1, 2, 3))
    with pytest.raises(ValueError, match=r"draft_logits: contains NaN at \[1, 2, 3\]"):
        build_tree_from_logits(x, 4, impl="ref", validate=False)
    x[0, 0] = float("nan")  # a wholly NaN row too
    tree = build_tree_from_logits(x, 4, impl="triton", validate=False)
    assert tree.tokens.shape == (2, 4) and tree.parents.shape == (2, 5)
    assert bool(((tree.num_nodes >= 0) & (tree.num_nodes <= 4)).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_top_logprobs_nan_inf_named_masked_accepted(impl):
    lp, ids = good()
    bad = lp.clone()
    bad[1, 0, 2] = float("nan")
    with pytest.raises(ValueError, match=r"top_logprobs: contains NaN at \[1, 0, 2\]"):
        build_tree(bad, ids, 4, impl=impl)
    bad = lp.clone()
    bad[0, 2, 0] = INF
    with pytest.raises(ValueError, match=r"top_logprobs: contains \+inf at \[0, 2, 0\]"):
        build_tree(bad, ids, 4, impl=impl)
    masked = lp.clone()
    masked[0, :, 2:] = -INF  # sorted tails
    masked[1, 1] = -INF  # a wholly masked depth: request 1 stops at depth 1
    tree = build_tree(masked, ids, 12, impl=impl)
    assert tree.num_nodes.tolist() == [12, 4]
    assert tree.depths[1, :4].tolist() == [1, 1, 1, 1]


def small_tree(b=2):
    lp, ids = good(b=b)
    return build_tree(lp, ids, 5)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_refuses_bad_root_tokens(impl):
    tree, starts = small_tree(), torch.tensor([0, 3])
    with pytest.raises(ValueError, match=r"root_tokens: expected values >= 0, got -1 at \[1\]"):
        compile_tree(tree, torch.tensor([4, -1]), starts, impl=impl)
    with pytest.raises(ValueError, match=r"root_tokens: .*\[0, vocab_size=100\), got 1000000000 at \[0\]"):
        compile_tree(tree, torch.tensor([10**9, 5]), starts, vocab_size=100, impl=impl)
    with pytest.raises(ValueError, match=r"start_positions: expected values >= 0, got -2 at \[0\]"):
        compile_tree(tree, torch.tensor([1, 2]), torch.tensor([-2, 0]), vocab_size=100, impl=impl)
    for vocab in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="vocab_size"):
            compile_tree(tree, torch.tensor([1, 2]), starts, vocab_size=vocab, impl=impl)
    compile_tree(tree, torch.tensor([99, 0]), starts, vocab_size=100, impl=impl)  # the bounds are fine
    compile_tree(tree, torch.tensor([10**9, 5]), starts, impl=impl)  # no vocab_size: no upper bound
    compile_tree(tree, torch.tensor([-1, 5]), starts, impl=impl, validate=False)  # no value checks


@pytest.mark.parametrize("impl", IMPLS)
def test_accept_greedy_refuses_bad_target_tokens(impl):
    tree = small_tree()
    target = torch.zeros(2, 6, dtype=torch.long)
    target[1, 3] = -1
    with pytest.raises(ValueError, match=r"target_tokens: expected values >= 0, got -1 at \[1, 3\]"):
        accept_greedy(tree, target, impl=impl)
    target[1, 3] = 0
    target[0, 5] = 10**9
    accept_greedy(tree, target, impl=impl)  # no vocab_size: no upper bound
    with pytest.raises(ValueError, match=r"target_tokens: .*vocab_size=50\), got 1000000000 at \[0, 5\]"):
        accept_greedy(tree, target, vocab_size=50, impl=impl)
    with pytest.raises(ValueError, match="vocab_size"):
        accept_greedy(tree, target, vocab_size=0, impl=impl)
    target[0, 5] = -7
    result = accept_greedy(tree, target, vocab_size=50, impl=impl, validate=False)  # no value checks
    assert result.accept_len.shape == (2,)


class CountReads:
    """Counts Tensor.tolist and Tensor.__bool__ calls, the host reads of the checks."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("tolist", "__bool__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.wrap(original))

    def wrap(self, original):
        def counted(t, *args):
            self.count += 1
            return original(t, *args)

        return counted


@pytest.mark.skipif(not ON_CPU, reason="CPU inputs to the Triton path: interpreter only")
def test_token_checks_read_the_data_once(monkeypatch):
    tree, roots, starts, target = small_tree(), torch.tensor([1, 2]), torch.tensor([0, 3]), torch.ones(2, 6)
    reads = CountReads(monkeypatch)
    compile_tree(tree, roots, starts, vocab_size=10, impl="triton")
    assert reads.count == 1
    reads.count = 0
    accept_greedy(tree, target.long(), vocab_size=10, impl="triton")
    assert reads.count == 1
    reads.count = 0
    compile_tree(tree, roots, starts, impl="triton", validate=False)
    accept_greedy(tree, target.long(), impl="triton", validate=False)
    assert reads.count == 0


@pytest.mark.gpu
def test_token_checks_sync_once_gpu():
    """On CUDA: one host sync per validated compile_tree / accept_greedy call, none with validate=False."""
    cuda = torch.device("cuda")
    lp, ids = good()
    tree = build_tree(lp.to(cuda), ids.to(cuda), 5, validate=False)
    roots, starts = torch.tensor([1, 2], device=cuda), torch.tensor([0, 3], device=cuda)
    target = torch.ones(2, 6, dtype=torch.long, device=cuda)
    torch.cuda.synchronize()
    calls = (
        lambda validate: compile_tree(tree, roots, starts, vocab_size=10, validate=validate),
        lambda validate: accept_greedy(tree, target, vocab_size=10, validate=validate),
    )
    for (validate, syncs), call in itertools.product(((True, 1), (False, 0)), calls):
        call(validate)  # compiles the kernel outside the count
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call(validate)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # count the syncs only: switching the debug mode on also warns ("Synchronization debug mode is a
        # prototype feature"), which a bare "synchroniz" match counted as a second sync on the H200
        assert sum("called a synchronizing CUDA operation" in str(w.message) for w in seen) == syncs
