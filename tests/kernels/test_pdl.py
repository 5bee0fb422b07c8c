"""Programmatic dependent launch (kernels/_pdl.py): when it is on, and that every kernel of a forward
and a draft launched with it waits for its predecessor before its first memory access, compiled for
sm_90 exactly as the package launches them (launch_compile.py: the shipped kimi-nano target's forward at
a decode step and a 33-node verify, its drafter's draft, and an attention plan on pages of 1; the Hopper
kernel's own compile test covers the Gluon kernel; the tree kernels' PDL launches are exercised by their
GPU tests). The overlap itself is timed on the GPU by scripts/probe_pdl.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tests.kernels.launch_compile import run_launch_script

from kdtree_engine.kernels import _pdl

BODY = r"""
from kdtree_engine.assets import KIMI_NANO, KIMI_NANO_DFLASH
from kdtree_engine.attention import plan_attention
from kdtree_engine.bench.forward_cost import draft_call, forward_call
from kdtree_engine.drafter import load_drafter
from kdtree_engine.kernels import _pdl
from kdtree_engine.model.loader import load_model

_pdl.enabled = lambda device: True  # as on an sm_90 GPU


found = {}
with torch.no_grad():
    nano = aligned(load_model(KIMI_NANO, dtype=torch.bfloat16))
    for t in (1, 33):
        forward_call(nano, 2, t, 256, "triton")()
    draft_call(aligned(load_drafter(KIMI_NANO_DFLASH, dtype=torch.bfloat16)), nano, 2, 256, "triton")[1]()
    q = torch.zeros(2, 9, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2 * 4096, 1, 576, dtype=torch.bfloat16)
    table = torch.arange(2 * 4096, dtype=torch.int32).view(2, -1)
    plan = plan_attention(q, kv, torch.full((2,), 4096), softmax_scale=0.1, d_v=512, block_table=table,
                          impl="triton", validate=False)
    plan.run(q, kv)
for name, kernel, constants in _COMPILED:
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    writes = len(re.findall(r"\b(st|red|atom)\.[\w.]*global", ptx[:wait])) if wait >= 0 else -1  # global
    found.setdefault(name, []).append({"pdl": kernel.metadata.launch_pdl, "PDL": constants.get("PDL"),
                                       "weight_first": constants.get("WEIGHT_FIRST", False),
                                       "before_wait": memory_before_wait(ptx), "writes_before_wait": writes})
print(json.dumps(found))
"""

# every Triton kernel a kimi-nano forward, its draft and an attention plan launch (none of the torch /
# cuBLAS ones)
FORWARD_KERNELS = {"_rmsnorm_kernel", "_add_rmsnorm_kernel", "_logits_kernel", "_route_kernel",
                   "_tile_map_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel", "_latent_kernel",
                   "_rope_kernel", "_split_kv_kernel", "_merge_splits_kernel", "_drafter_attention_kernel",
                   "_block_kernel", "_context_kernel", "_silu_mul_kernel", "_linear_kernel"}  # fmt: skip
# kernels that may read a weight (a parameter no kernel writes) before their wait: only loads there
WEIGHT_BEFORE_WAIT = {"_linear_kernel"}


def test_enabled_only_on_compiled_sm90_launches(monkeypatch):
    assert not _pdl.enabled(torch.device("cpu")) and _pdl.launch(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KDTREE_ENGINE_PDL", "0")
    assert not _pdl.enabled(torch.device("cuda", 0)) and _pdl.launch(torch.device("cuda", 0)) == {}
    monkeypatch.setenv("KDTREE_ENGINE_PDL", "1")
    monkeypatch.setattr(_pdl, "_capable", lambda index: index == 3)
    assert _pdl.launch(torch.device("cuda", 3)) == {"PDL": True, "launch_pdl": True}
    assert not _pdl.enabled(torch.device("cuda", 2))


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_launch_script(BODY)


def test_every_forward_kernel_waits_before_touching_memory(compiled):
    assert FORWARD_KERNELS <= set(compiled), FORWARD_KERNELS - set(compiled)
    for name, reports in compiled.items():
        for r in reports:
            assert r["pdl"] is True and r["PDL"] is True, (name, r)
            if r["weight_first"]:  # the small-M GEMM's first weight tile: loads, nothing written
                assert name in WEIGHT_BEFORE_WAIT and r["writes_before_wait"] == 0, (name, r)
                continue
            assert r["before_wait"] == 0, f"{name}: {r['before_wait']} memory accesses before the wait"
    assert any(r["weight_first"] for r in compiled["_linear_kernel"]), "the small-M GEMM's PDL build"


KERNELS_DIR = Path(_pdl.__file__).parent
# the modules whose kernels launch with PDL: every module of ours with a kernel launched in a forward, a
# draft, an engine round or the SGLang integration's steps
PDL_MODULES = {"rmsnorm", "moe", "moe_router", "mla_latent", "rope", "mla_attention_hopper",
               "mla_attention_triton", "mla_attention_merge", "mla_attention_schedule", "drafter_attention",
               "drafter_mlp", "drafter_qkv", "tree_topk", "tree_build", "tree_compile", "tree_accept",
               "tree_sample", "tree_visibility", "cache_compact", "round_report", "round_commit",
               "sglang_attention", "sglang_sample", "sglang_verify", "linear"}  # fmt: skip


def _pdl_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """The kernels (not the jit helpers) of a module that take PDL."""
    return {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.endswith("kernel")
            and any(a.arg == "PDL" for a in f.args.args)}  # fmt: skip


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if doc else body[0]


def _is_wait(stmt: ast.stmt) -> bool:
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and getattr(call.func, "id", "") in ("wait_then_release",
            "gluon_wait_then_release") and [getattr(a, "id", "") for a in call.args] == ["PDL"])  # fmt: skip


def _memory_calls(stmt: ast.stmt) -> list[ast.Call]:
    """The tl.load / tl.store / tl.atomic_* calls in a statement."""
    return [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and (n.func.attr in ("load", "store") or n.func.attr.startswith("atomic"))]  # fmt: skip


def _waits_after_weight_loads(fn: ast.FunctionDef) -> bool:
    """A WEIGHT_BEFORE_WAIT kernel: no memory access before `if WEIGHT_FIRST:`, whose branch loads from
    the weight's pointers (w_cols) only, then waits; the other branch waits first."""
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body
    at = next(
        i for i, s in enumerate(body) if isinstance(s, ast.If) and getattr(s.test, "id", "") == "WEIGHT_FIRST"
    )
    if any(_memory_calls(s) for s in body[:at]) or not body[at].orelse or not _is_wait(body[at].orelse[0]):
        return False
    branch = body[at].body
    wait = next((i for i, s in enumerate(branch) if _is_wait(s)), None)
    loads = [c for s in branch[: wait or 0] for c in _memory_calls(s)]
    return wait is not None and all(
        c.func.attr == "load" and "w_cols" in ast.unparse(c.args[0]) for c in loads
    )


def _launches(tree: ast.Module, names: set[str]):
    """(kernel name, launch Call) for kernel[grid](...) and partial(kernel[grid], ...)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = node.func if isinstance(node.func, ast.Subscript) else (node.args[0] if node.args else None)
        if (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and target.value.id in names
        ):
            yield target.value.id, node


def test_every_pdl_kernel_waits_first_and_every_launch_asks_for_pdl():
    """In the source: each kernel that takes PDL calls (gluon_)wait_then_release(PDL) as its first
    statement, and each of its launches passes **pdl.launch(...), so PDL is on wherever it may be."""
    found = set()
    for path in sorted(KERNELS_DIR.glob("*.py")):
        if path.stem == "_pdl":
            continue
        tree = ast.parse(path.read_text())
        kernels = _pdl_kernels(tree)
        if not kernels:
            continue
        found.add(path.stem)
        for name, fn in kernels.items():
            if name in WEIGHT_BEFORE_WAIT:
                assert _waits_after_weight_loads(fn), (
                    f"{path.name}: {name} touches more than its weight first"
                )
                continue
            assert _is_wait(_first_statement(fn)), f"{path.name}: {name} does not wait first"
        launched = set()
        for name, call in _launches(tree, set(kernels)):
            launched.add(name)
            extra = [k.value for k in call.keywords if k.arg is None]
            assert any(ast.unparse(v).startswith("pdl.launch(") for v in extra), (
                f"{path.name}: a {name} launch"
            )
        assert launched == set(kernels), f"{path.name}: {set(kernels) - launched} never launched here"
    assert found == PDL_MODULES, found ^ PDL_MODULES
