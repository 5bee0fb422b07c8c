"""Replay the committed tree bundles: the ops on the stored inputs must give the stored outputs exactly.
A changed reference shows up here; regenerate with `kdtree-engine golden --regen` and review the diff."""

from pathlib import Path

import pytest
import torch

from kdtree_engine.golden import read_bundle
from kdtree_engine.golden.tree_cases import CASES
from kdtree_engine.tree import accept_greedy, build_tree, build_tree_from_logits, compile_tree

HERE = Path(__file__).parent


# The Triton interpreter (CPU CI) is slow: it replays the small bundles; a GPU replays them all.
INTERPRETER_MAX_BUDGET = 16


def impls():
    try:
        import kdtree_engine.kernels.tree_build  # noqa: F401
    except ImportError:
        return ["ref"]
    return ["ref", "triton"]


def check_from_logits(logits, budget: int, impl: str, t: dict) -> None:
    """Every impl must rebuild the stored tree from the logits, and the kernel's top-k must be the stored
    one bit for bit (log-probs included: the normalizer is the same on every device)."""
    tree = build_tree_from_logits(logits, budget, impl=impl)
    assert torch.equal(tree.parents.cpu(), t["out.parents"])
    assert torch.equal(tree.tokens.cpu(), t["out.tokens"])
    if impl == "ref" or budget == 0:
        return
    from kdtree_engine.kernels.tree_topk import logits_topk

    lp, ids = logits_topk(logits, min(budget, logits.shape[-1]))
    assert torch.equal(ids.cpu(), t["in.top_ids"])
    assert torch.equal(lp.cpu(), t["in.top_logprobs"])


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("name", sorted(CASES))
def test_replay(name, impl):
    bundle = read_bundle(HERE / f"{name}.safetensors")
    if (
        impl == "triton"
        and not torch.cuda.is_available()
        and bundle.params["budget"] > INTERPRETER_MAX_BUDGET
    ):
        pytest.skip("large budget: replayed through the kernels on a GPU only")
    dev = torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")
    t, budget = bundle.tensors, bundle.params["budget"]
    inputs = {k: v.to(dev) for k, v in t.items() if k.startswith("in.")}
    assert bundle.meta["op"] == "tree"
    tree = build_tree(inputs["in.top_logprobs"], inputs["in.top_ids"], budget, impl=impl)
    for key in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(tree, key).cpu(), t[f"out.{key}"]), key
    check_from_logits(inputs["in.logits"], budget, impl, t)
    verify = compile_tree(tree, inputs["in.root_tokens"], inputs["in.start_positions"], impl=impl)
    for key in (
        "input_ids",
        "positions",
        "visibility",
        "ancestor_bits",
        "retrieve_index",
        "retrieve_next_token",
        "retrieve_next_sibling",
    ):
        got = getattr(verify, key)
        if f"out.{key}" not in t:
            assert got is None, key
            continue
        assert torch.equal(got.cpu(), t[f"out.{key}"]), key
    res = accept_greedy(tree, inputs["in.target_tokens"], impl=impl)
    for key in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(res, key).cpu(), t[f"out.{key}"]), key


def test_bundles_carry_metadata():
    for name in CASES:
        meta = read_bundle(HERE / f"{name}.safetensors").meta
        assert {"op", "seed", "params", "shapes", "generator_version"} <= meta.keys()


def test_reading_a_missing_bundle_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="path"):
        read_bundle(tmp_path / "nope.safetensors")
