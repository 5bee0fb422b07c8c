"""Issue 26, tree ops and attention: bad arguments get a ValueError naming the argument, not a Triton
driver error, a numpy allocation error or a silent token: a kernel impl on CPU tensors outside the Triton
interpreter (`impl`), a budget beyond what the ops build (`budget`), and target logits that are not a
distribution in accept_sampled (`target_logits`)."""

from __future__ import annotations

import importlib
import itertools
import warnings
from functools import partial

import pytest
import torch

from kdtree_engine import attention
from kdtree_engine.impl import check_impl, resolve_impl
from kdtree_engine.kernels import TREE_KERNELS
from kdtree_engine.ref.tree import MAX_BUDGET
from kdtree_engine.tree import accept_greedy, accept_sampled, build_tree, build_tree_from_logits, compile_tree

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = (
    r"impl: '(triton|hopper)' runs GPU kernels and needs CUDA tensors, got tensors on cpu; use impl='ref'"
)


def top_k(b=2, depth=3, k=4):
    lp = torch.sort(torch.randn(b, depth, k, generator=torch.Generator().manual_seed(0)), -1, True).values
    return lp, torch.arange(b * depth * k).reshape(b, depth, k)


def small_tree():
    return build_tree(*top_k(), 5, impl="ref")


def attention_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 576, generator=g)
    return q, torch.randn(1, 16, 576, generator=g), torch.tensor([8])


def calls(impl: str):
    """Every public op that takes `impl`, called on good CPU inputs."""
    tree = small_tree()
    q, kv, lens = attention_inputs()
    return {
        "build_tree": lambda: build_tree(*top_k(), 5, impl=impl),
        "build_tree_from_logits": lambda: build_tree_from_logits(torch.randn(2, 5, 100), budget=8, impl=impl),
        "compile_tree": lambda: compile_tree(tree, torch.tensor([1, 2]), torch.tensor([0, 3]), impl=impl),
        "accept_greedy": lambda: accept_greedy(tree, torch.zeros(2, 6, dtype=torch.long), impl=impl),
        "accept_sampled": lambda: accept_sampled(
            tree, torch.randn(2, 6, 30), temperature=1.0, seed=1, impl=impl
        ),
        "tree_mla_attention": lambda: attention.tree_mla_attention(q, kv, lens, softmax_scale=0.1, impl=impl),
        "plan_attention": lambda: attention.plan_attention(q, kv, lens, softmax_scale=0.1, impl=impl),
    }


# --- impl on CPU tensors ---------------------------------------------------------------------------------


@pytest.fixture
def no_interpreter(monkeypatch):
    """TRITON_INTERPRET unset for the test (restored after). Triton and the kernel modules are imported
    first, as conftest configured them: `triton.jit` reads the variable when a module is imported, and
    a module imported without it would stay compiled-only for the rest of the session."""
    import triton.language  # noqa: F401

    import kdtree_engine.kernels.mla_attention_hopper  # noqa: F401
    import kdtree_engine.kernels.mla_attention_triton  # noqa: F401

    for module in TREE_KERNELS:
        importlib.import_module(module)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("impl", ["triton", "hopper"])
@pytest.mark.parametrize("op", list(calls("ref")))
def test_kernel_impl_on_cpu_tensors_names_impl(no_interpreter, impl, op):
    """Without the Triton interpreter a kernel impl on CPU tensors raised `RuntimeError: 0 active
    drivers` (hopper attention: a message about compute capability): now a ValueError naming `impl`."""
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        calls(impl)[op]()


@pytest.mark.parametrize("op", list(calls("ref")))
def test_default_and_ref_impl_run_on_cpu_without_interpreter(no_interpreter, op):
    for impl in (None, "ref"):
        calls(impl)[op]()


@pytest.mark.skipif(
    HAS_CUDA, reason="the kernels were loaded compiled: the interpreter is for CPU-only hosts"
)
def test_interpreter_still_runs_kernels_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(
        build_tree_from_logits(logits, 6, impl="triton").parents, build_tree_from_logits(logits, 6).parents
    )


def test_check_impl_with_device(no_interpreter, monkeypatch):
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        check_impl("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        resolve_impl("hopper", torch.device("cpu"))
    check_impl("triton")  # without a device: the name only
    check_impl("ref", "cpu")
    assert resolve_impl(None, torch.device("cpu")) == "ref"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", torch.device("cpu")) == "triton"


# --- budget ----------------------------------------------------------------------------------------------

TOO_BIG = r"budget: expected an int in \[0, 4096\] \(the most nodes a tree op builds, every impl\), got "


@pytest.mark.parametrize("budget", [2**62, 2**31, MAX_BUDGET + 1])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_budget_beyond_the_bound_names_budget(budget, impl):
    """budget=2**62 gave numpy's "array is too big"; the bound is checked before any allocation."""
    with pytest.raises(ValueError, match=TOO_BIG + str(budget)):
        build_tree_from_logits(torch.randn(1, 3, 50), budget=budget, impl=impl)
    with pytest.raises(ValueError, match=TOO_BIG + str(budget)):
        build_tree(*top_k(b=1), budget, impl=impl)


def test_budget_bound_is_the_kernels_and_is_accepted():
    from kdtree_engine.kernels.tree_build import MAX_BUDGET as KERNEL_MAX_BUDGET

    assert MAX_BUDGET == KERNEL_MAX_BUDGET == 4096
    logits = torch.randn(1, 3, 20, generator=torch.Generator().manual_seed(2))
    tree = build_tree_from_logits(logits, MAX_BUDGET, impl="ref")
    assert tree.budget == MAX_BUDGET and int(tree.num_nodes[0]) == MAX_BUDGET  # 20 + 20^2 + 20^3 candidates
    with pytest.raises(ValueError, match=r"budget: expected >= 0, got -1"):  # the lower bound's message
        build_tree_from_logits(logits, -1)


def test_tree_cli_refuses_a_budget_beyond_the_bound(capsys):
    from kdtree_engine.cli import main

    assert main(["tree", "--budget", str(MAX_BUDGET + 1)]) == 2
    err = capsys.readouterr().err
    assert err == f"kdtree-engine tree: --budget: expected <= {MAX_BUDGET}, got {MAX_BUDGET + 1}\n"


# --- accept_sampled: target logits that are not a distribution ------------------------------------------


def sampled_inputs(device: torch.device | str = "cpu"):
    """A tree and target logits [2, 6, 30] on device (the kernels run on the CPU through the Triton
    interpreter, where conftest turns it on)."""
    lp, ids = top_k()
    tree = build_tree(lp.to(device), ids.to(device), 5, impl="ref")
    return tree, torch.randn(2, 6, 30, generator=torch.Generator().manual_seed(3)).to(device)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize(
    "mode",
    [dict(seed=7, offset=2), dict(noise="zeros"), dict(generator="seeded"), dict(top_k=3), dict(top_p=0.5)],
)
def test_sampled_refuses_nan_and_empty_rows(device, impl, mode):
    """An all-NaN row sampled token 0, NaN elsewhere and all -inf rows passed silently."""
    tree, logits = sampled_inputs(device)
    opts = dict(mode)
    if opts.get("noise") == "zeros":
        opts["noise"] = torch.zeros_like(logits)
    if opts.get("generator") == "seeded":
        opts["generator"] = torch.Generator(device=device).manual_seed(0)
    run = lambda x: accept_sampled(tree, x, temperature=0.7, impl=impl, **opts)  # noqa: E731
    run(logits)
    x = logits.clone()
    x[1, 2] = float("nan")  # a wholly NaN row: the first NaN is named
    with pytest.raises(ValueError, match=r"^target_logits: contains NaN at \[1, 2, 0\]$"):
        run(x)
    x = logits.clone()
    x[0, 4, 17] = float("nan")
    with pytest.raises(ValueError, match=r"^target_logits: contains NaN at \[0, 4, 17\]$"):
        run(x)
    x = logits.clone()
    x[1, 3] = float("-inf")
    with pytest.raises(
        ValueError,
        match=r"^target_logits: row \[1, 3\] has no finite logit \(all -inf\): not a distribution$",
    ):
        run(x)
    x = logits.clone()
    x[0, 1, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^target_logits: contains \+inf at \[0, 1, 5\]$"):
        run(x)
    x = logits.clone()
    x[0, 0, :29] = float("-inf")  # one finite logit: a distribution (that token), kept by every filter
    assert int(run(x)[1][0, 0]) == 29


def test_sampled_refuses_a_row_that_the_temperature_sends_to_minus_inf():
    tree, logits = sampled_inputs()
    x = logits.clone()
    x[1, 5] = -3e38  # finite, but -3e38 / 0.01 overflows float32 to -inf
    with pytest.raises(
        ValueError,
        match=r"^target_logits: row \[1, 5\] is -inf everywhere after dividing by temperature=0\.01 \(its "
        r"largest logit is -3e\+38\): not a distribution; raise the temperature$",
    ):
        accept_sampled(tree, x, temperature=0.01, seed=1, impl="ref")
    accept_sampled(tree, x, temperature=1.0, seed=1, impl="ref")


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_sampled_validate_false_skips_the_check(device, impl):
    tree, logits = sampled_inputs(device)
    logits[0, 0] = float("nan")
    logits[1, 1] = float("-inf")
    result, sampled = accept_sampled(tree, logits, temperature=1.0, seed=1, impl=impl, validate=False)
    assert sampled.shape == (2, 6) and result.accept_len.shape == (2,)


@pytest.mark.gpu
def test_sampled_check_syncs_once_gpu():
    """On CUDA: one host sync per validated accept_sampled call (the NaN / -inf check), none with
    validate=False."""
    cuda = torch.device("cuda")
    lp, ids = top_k()
    tree = build_tree(lp.to(cuda), ids.to(cuda), 5, validate=False)
    logits = torch.randn(2, 6, 1000, device=cuda)
    with warnings.catch_warnings(record=True):  # the first switch to "warn" can report a sync of its own
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")
    for (validate, syncs), opts in itertools.product(
        ((True, 1), (False, 0)),
        (dict(seed=3, offset=1), dict(seed=3, top_k=20, top_p=0.9), dict(noise=torch.zeros_like(logits))),
    ):
        call = partial(accept_sampled, tree, logits, temperature=0.8, validate=validate, **opts)
        call()  # compiles the kernel outside the count
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert sum("synchroniz" in str(w.message) for w in seen) == syncs
    bad = logits.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits: contains NaN at \[1, 2, 3\]"):
        accept_sampled(tree, bad, temperature=0.8, seed=3)


def test_logits_topk_is_what_build_tree_from_logits_builds_from():
    """tree.logits_topk then build_tree: the tree build_tree_from_logits gives, ties and masked tokens
    included; k larger than the vocabulary takes it all; a k of 0 or a bad budget names `k`."""
    from kdtree_engine.tree import logits_topk

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 4, 11, generator=gen) * 2).round()  # plateaus: ties broken by id
    logits[2, :, 6:] = float("-inf")
    for budget in (1, 7, 30):
        lp, ids = logits_topk(logits, budget, impl="ref")
        assert lp.shape == ids.shape == (3, 4, min(budget, 11))
        got, want = (
            build_tree(lp, ids, budget, impl="ref"),
            build_tree_from_logits(logits, budget, impl="ref"),
        )
        for name in ("tokens", "depths", "parents", "num_nodes"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    for k in (0, -1, 5000):
        with pytest.raises(ValueError, match="k|budget"):
            logits_topk(logits, k, impl="ref")
