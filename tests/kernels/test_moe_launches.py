"""The launches of one MoE layer forward (model.moe.MoE, impl="triton"), counted on the CPU: the ATen
ops that run a device kernel (recorded by a TorchDispatchMode: views and allocations do not) and the
Triton launches (the interpreter's, counted by name). A bf16 layer at scaled-down Kimi's E = 32, k = 6
runs six at 1 and at 33 tokens: the router's partial-logit matmul and routing, the tile map, gate_up
and down (routed and shared experts), the combine. It ran 15 ATen ops and Triton launches before (the
float32 cast of x and a cuBLAS matmul for the router, a stable torch.sort, the sum and cast of the
combine, and five ops of the shared expert and the add, each its own launch)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kdtree_engine.model.moe import MoE
from kdtree_engine.model.testing import tiny_config

NO_KERNEL = ("empty", "empty_like", "empty_strided", "lift_fresh", "_unsafe_view")  # allocations, a view


class Launches(TorchDispatchMode):
    """Records "aten.<op>" for every dispatched op that is not a view or an allocation, and
    "triton.<kernel>" for every Triton interpreter launch (the ops inside a launch not recorded)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self._in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        name = func.overloadpacket.__name__
        if not self._in_kernel and not view and name not in NO_KERNEL:
            self.names.append("aten." + name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter

        self._run, recorder = interpreter.InterpretedFunction.run, self

        def run(fn, *args, **kwargs):
            recorder.names.append("triton." + fn.fn.__name__)
            recorder._in_kernel = True
            try:
                return recorder._run(fn, *args, **kwargs)
            finally:
                recorder._in_kernel = False

        interpreter.InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime import interpreter

        interpreter.InterpretedFunction.run = self._run
        return super().__exit__(*exc)


EXPECTED = [f"triton._{k}_kernel" for k in ("logits", "route", "tile_map", "gate_up", "down", "combine")]


@pytest.mark.parametrize("n", [1, 33])
def test_moe_layer_runs_six_launches(n):
    if torch.cuda.is_available():
        pytest.skip("counts the Triton interpreter's launches (CPU)")
    c = tiny_config(n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1)
    layer = MoE(c)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(1, n, c.hidden_size).bfloat16()
    with torch.no_grad(), Launches() as launches:
        layer(x, "triton")
    assert launches.names == EXPECTED
