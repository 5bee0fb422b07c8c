"""Programmatic dependent launch (kernels/_pdl.py): when it is on, and that every kernel of a forward
and a draft launched with it waits for its predecessor before its first memory access, compiled for
sm_90 exactly as the package launches them (launch_compile.py: the shipped kimi-nano target's forward at
a decode step and a 33-node verify, its drafter's draft, and an attention plan on pages of 1; the Hopper
kernel's own compile test covers the Gluon kernel; the tree kernels' PDL launches are exercised by their
GPU tests). The overlap itself is timed on the GPU by scripts/probe_pdl.py."""

from __future__ import annotations

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


def order(ptx):
    at = ptx.find("griddepcontrol.wait")
    return -1 if at < 0 else len(re.findall(r"\b(ld|st|cp\.async|red|atom)\.[\w.]*(global|shared)", ptx[:at]))


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
    found.setdefault(name, []).append({"pdl": kernel.metadata.launch_pdl, "PDL": constants.get("PDL"),
                                       "before_wait": order(kernel.asm["ptx"])})
print(json.dumps(found))
"""

# every Triton kernel a kimi-nano forward, its draft and an attention plan launch (none of the torch /
# cuBLAS ones)
FORWARD_KERNELS = {"_rmsnorm_kernel", "_add_rmsnorm_kernel", "_logits_kernel", "_route_kernel",
                   "_tile_map_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel", "_latent_kernel",
                   "_rope_kernel", "_split_kv_kernel", "_merge_splits_kernel", "_drafter_attention_kernel",
                   "_block_kernel", "_context_kernel", "_silu_mul_kernel"}  # fmt: skip


def test_enabled_only_on_compiled_sm90_launches(monkeypatch):
    assert not _pdl.enabled(torch.device("cpu")) and _pdl.launch(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KDTREE_PDL", "0")
    assert not _pdl.enabled(torch.device("cuda", 0)) and _pdl.launch(torch.device("cuda", 0)) == {}
    monkeypatch.setenv("KDTREE_PDL", "1")
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
            assert r["before_wait"] == 0, f"{name}: {r['before_wait']} memory accesses before the wait"
