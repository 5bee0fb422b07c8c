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
INTERPRETER_MAX_BUDGET = 8


def impls():
    try:
        import kdtree_engine.kernels.tree  # noqa: F401
    except ImportError:
        return ["ref"]
    return ["ref", "triton"]


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
    if impl == "triton" and torch.cuda.is_available():
        bundle = type(bundle)({k: v.cuda() for k, v in bundle.tensors.items()}, bundle.meta)
    t, budget = bundle.tensors, bundle.params["budget"]
    assert bundle.meta["op"] == "tree"
    tree = build_tree(t["in.top_logprobs"], t["in.top_ids"], budget, impl=impl)
    for key in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(tree, key).cpu(), t[f"out.{key}"]), key
    from_logits = build_tree_from_logits(t["in.logits"], budget, impl=impl)
    assert torch.equal(from_logits.parents.cpu(), t["out.parents"])
    assert torch.equal(from_logits.tokens.cpu(), t["out.tokens"])
    verify = compile_tree(tree, t["in.root_tokens"], t["in.start_positions"], impl=impl)
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
    res = accept_greedy(tree, t["in.target_tokens"], impl=impl)
    for key in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(res, key).cpu(), t[f"out.{key}"]), key


def test_bundles_carry_metadata():
    for name in CASES:
        meta = read_bundle(HERE / f"{name}.safetensors").meta
        assert {"op", "seed", "params", "shapes", "generator_version"} <= meta.keys()


def test_reading_a_missing_bundle_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="path"):
        read_bundle(tmp_path / "nope.safetensors")
