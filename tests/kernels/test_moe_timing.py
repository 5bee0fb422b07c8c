"""GPU micro-timing of one MoE layer forward at bench e2e's scaled-down Kimi layer (H 2048, I = Is = 768,
E 32, k 6, bf16), 1 and 33 tokens: GPU time per call by the one timing harness (bench.timing.time_graph:
a CUDA graph of the call, replays timed by triton.testing.do_bench, median, L2 flushed) and the CUDA
kernels of one eager call (bench.timing.count_kernels).

- layer: model.moe.MoE with impl="triton": router, then the four launches of kernels.moe;
- split: the launches before this work except the sort and the combine: the router as a float32 cast,
  a cuBLAS matmul and the routing launch, kernels.moe.moe_experts on the routed experts only, the
  shared expert as model.moe.MLP (three cuBLAS GEMMs, silu, mul) and the add;
- tile_map: the one-launch grouping (histogram, counting sort, tiles); argsort: the
  torch.argsort(stable=True) of the flat ids it replaces;
- router: kernels.moe_router.route_hidden (partial-logit matmul + routing); router_cublas: the float32
  cast of x, the cuBLAS matmul and the routing launch it replaces.

Writes its lines to $OUT/moe_timing.txt when OUT is set. Run with -s to see them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kdtree_engine.kernels import moe as kernels
from kdtree_engine.kernels.moe_router import route, route_hidden
from kdtree_engine.model.moe import MoE
from kdtree_engine.model.testing import tiny_config

KIMI_SMALL = dict(hidden_size=2048, moe_intermediate_size=768, n_routed_experts=32, num_experts_per_tok=6,
                  n_shared_experts=1, n_group=1, topk_group=1)  # fmt: skip


def report(line: str) -> None:
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_timing.txt"), "a") as f:
            f.write(line + "\n")


def layer_on_gpu() -> MoE:
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = MoE(tiny_config(**KIMI_SMALL))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return layer.to(torch.bfloat16).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33])
@torch.no_grad()
def test_moe_layer_timing(n):
    from kdtree_engine.bench.timing import count_kernels, time_graph

    layer = layer_on_gpu()
    x = torch.randn(1, n, layer.c.hidden_size, device="cuda").bfloat16()
    flat = x.view(n, -1)
    weights, ids = layer.gate(flat, "triton")
    routed = layer.experts.gate_up_proj, layer.experts.down_proj
    block_m = kernels.launch_config(ids.numel(), layer.c.n_routed_experts, 2).block_m
    router, c = layer.gate, layer.c
    settings = dict(n_group=c.n_group, topk_group=c.topk_group, top_k=c.num_experts_per_tok,
                    norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)  # fmt: skip

    def router_cublas():
        return route(F.linear(flat.float(), router.weight), router.e_score_correction_bias, **settings)

    def split():
        w, i = router_cublas()
        return kernels.moe_experts(flat, w, i, *routed) + layer.shared_experts(flat)

    calls = {
        "layer": lambda: layer(x, "triton"),
        "split": split,
        "tile_map": lambda: kernels.tile_map(ids, layer.c.n_routed_experts, block_m),
        "argsort": lambda: torch.argsort(ids.reshape(-1), stable=True),
        "router": lambda: route_hidden(flat, router.weight, router.e_score_correction_bias, **settings),
        "router_cublas": router_cublas,
    }
    found = {}
    for name, fn in calls.items():
        found[name] = (time_graph(fn).median_us, count_kernels(fn))
        report(f"moe n={n} {name}: {found[name][0]:.1f} us (graph replay median), {found[name][1]} kernels")
    want = layer(x, "ref").float()
    scale = float(want.abs().max())
    torch.testing.assert_close(layer(x, "triton").float(), want, rtol=3e-2, atol=3e-2 * scale)
    assert found["layer"][1] < found["split"][1]
