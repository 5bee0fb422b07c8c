"""Issue 26, generate's boundary: wrong objects for target, drafter or prompts, and a kernel impl on a
CPU model, get a ValueError naming the argument (what was passed, what is expected) instead of an
AttributeError or a Triton driver error."""

from __future__ import annotations

import importlib

import pytest
import torch

from kdtree_engine.engine import GenerationConfig, generate
from kdtree_engine.engine.checks import check_drafter, check_target
from kdtree_engine.kernels import TREE_KERNELS
from tests.engine.helpers import tiny_drafter, tiny_target

CONFIG = GenerationConfig(max_new_tokens=4, budget=4)
PROMPTS = [[1, 2, 3]]
DRAFTER_EXPECTED = (
    r"a DFlash drafter, a kdtree_engine\.drafter\.DFlashDrafter \(e\.g\. from "
    r"kdtree_engine\.drafter\.load_drafter\)"
)
TARGET_CLASS = r"kdtree_engine\.model\.model\.DeepseekV3ForCausalLM"
TARGET_EXPECTED = (
    r"the target model, a kdtree_engine\.model\.DeepseekV3ForCausalLM \(e\.g\. from "
    r"kdtree_engine\.model\.load_model\)"
)


class HalfDrafter:
    """Has a drafter's block size and layer ids but cannot draft."""

    block_size = 4
    target_layer_ids = (0,)


def test_target_as_drafter_names_drafter():
    """generate(target, target, ...) raised AttributeError: 'DeepseekV3ForCausalLM' object has no
    attribute 'target_layer_ids'."""
    target = tiny_target(0)
    with pytest.raises(
        ValueError,
        match=rf"^drafter: got the target model itself \({TARGET_CLASS}\); "
        rf"method 'ddtree' needs {DRAFTER_EXPECTED}$",
    ):
        generate(target, target, PROMPTS, CONFIG)


@pytest.mark.parametrize(
    "drafter, got",
    [
        ("drafter", "str"),
        (42, "int"),
        ({"block_size": 4}, "dict"),
        ("another target", rf"{TARGET_CLASS} \(it has no block_size, target_layer_ids, draft\)"),
        (HalfDrafter(), r"tests\.engine\.test_api_errors\.HalfDrafter \(it has no new_cache, draft\)"),
    ],
)
@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_wrong_drafter_names_drafter(drafter, got, method):
    config = GenerationConfig(max_new_tokens=4, method=method)
    drafter = tiny_target(1) if drafter == "another target" else drafter
    with pytest.raises(ValueError, match=rf"^drafter: expected {DRAFTER_EXPECTED}, got {got}$"):
        generate(tiny_target(0), drafter, PROMPTS, config)


def test_missing_drafter_says_what_is_expected():
    with pytest.raises(
        ValueError, match=rf"^drafter: method 'dflash' needs a drafter: {DRAFTER_EXPECTED}, got None$"
    ):
        generate(tiny_target(0), None, PROMPTS, GenerationConfig(max_new_tokens=4, method="dflash"))


def test_drafter_with_bad_fields_names_drafter():
    class Odd(HalfDrafter):
        def new_cache(self, batch_size, max_len):
            raise AssertionError("not reached")

        def draft(self, *args, impl=None):
            raise AssertionError("not reached")

    odd = Odd()
    odd.target_layer_ids = 3  # not a sequence
    with pytest.raises(ValueError, match=r"^drafter: target_layer_ids must be a sequence of ints, got 3$"):
        generate(tiny_target(0), odd, PROMPTS, CONFIG)
    odd.target_layer_ids, odd.block_size = (0,), "4"
    with pytest.raises(ValueError, match=r"^drafter: block_size must be an int >= 2, got '4'$"):
        generate(tiny_target(0), odd, PROMPTS, CONFIG)


def test_drafter_passed_as_target_names_target():
    """generate(drafter, target, ...): the drafter has a config and new_cache, but no lm_head."""
    with pytest.raises(
        ValueError,
        match=rf"^target: expected {TARGET_EXPECTED}, got kdtree_engine\.drafter\.model\.DFlashDrafter "
        r"\(it has no lm_head, embed_tokens\)$",
    ):
        generate(tiny_drafter(0), tiny_target(0), PROMPTS, CONFIG)


@pytest.mark.parametrize(
    "target, got", [("model", "str"), (None, "None"), (torch.zeros(3), r"torch\.Tensor")]
)
def test_check_target_names_target(target, got):
    for check in (lambda: check_target(target), lambda: check_drafter(target, tiny_drafter(0), "ddtree")):
        with pytest.raises(ValueError, match=rf"^target: expected {TARGET_EXPECTED}, got {got}$"):
            check()


@pytest.mark.parametrize("target", ["model", None])
def test_generate_with_a_wrong_target_names_target(target):
    with pytest.raises(ValueError, match=rf"^target: expected {TARGET_EXPECTED}, got "):
        generate(target, tiny_drafter(0), PROMPTS, CONFIG)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ("1 2 3", r"^prompts: expected a non-empty list of prompts \(lists of token ids\), got str$"),
        (None, r"^prompts: expected a non-empty list of prompts \(lists of token ids\), got None$"),
        ((), r"^prompts: expected a non-empty list of prompts \(lists of token ids\), got an empty tuple$"),
        (["hello"], r"^prompts: prompt 0 must be a list of int token ids, got str$"),
        ([[1, 2], None], r"^prompts: prompt 1 must be a list of int token ids, got None$"),
        (
            torch.ones(1, 2, 3, dtype=torch.long),
            r"^prompts: expected a tensor \[B, T\] or \[T\], got shape \(1, 2, 3\)$",
        ),
        (torch.ones(1, 3, dtype=torch.bool), r"^prompts: expected integer token ids, got dtype torch\.bool$"),
    ],
)
def test_wrong_prompts_name_prompts(prompts, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_target(0), tiny_drafter(0), prompts, CONFIG)


@pytest.fixture
def no_interpreter(monkeypatch):
    """TRITON_INTERPRET unset for the test, after triton and the kernels were imported as conftest
    configured them (`triton.jit` reads the variable when a module is imported)."""
    import triton.language  # noqa: F401

    import kdtree_engine.kernels.mla_attention_triton  # noqa: F401
    import kdtree_engine.kernels.moe  # noqa: F401
    import kdtree_engine.kernels.rope  # noqa: F401

    for module in TREE_KERNELS:
        importlib.import_module(module)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("impl", ["triton", "hopper"])
@pytest.mark.parametrize("method", ["ddtree", "autoregressive"])
def test_kernel_impl_on_a_cpu_model_names_impl(no_interpreter, impl, method):
    """GenerationConfig(impl="triton") with a CPU model raised `RuntimeError: 0 active drivers`."""
    config = GenerationConfig(max_new_tokens=4, method=method, impl=impl)
    drafter = tiny_drafter(0) if method != "autoregressive" else None
    with pytest.raises(
        ValueError, match=rf"^impl: '{impl}' runs GPU kernels and needs CUDA tensors, got tensors on cpu"
    ):
        generate(tiny_target(0), drafter, PROMPTS, config)


def test_budget_beyond_the_tree_ops_names_budget():
    """A budget that fits in memory but beyond what the tree ops build (ref.tree.MAX_BUDGET)."""
    config = GenerationConfig(max_new_tokens=2, budget=5000)
    with pytest.raises(ValueError, match=r"^budget: expected an int in \[0, 4096\]"):
        generate(tiny_target(0), tiny_drafter(0, block_size=4), PROMPTS, config)
