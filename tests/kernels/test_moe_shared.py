"""The MoE layer after the router in four launches (kernels.moe.moe_experts with the shared expert:
tile map, gate_up, down, combine) against ref.moe.moe_experts_ref, and model.moe.MoE through both impls;
on the CPU through the Triton interpreter at small shapes, the realistic shapes, the CUDA-graph replay
and the batch independence at realistic shapes marked gpu.

Tolerances, relative to the output's largest magnitude, against the reference run in float32 on the
same values: float32 1e-4 (float32 accumulation in another order); bf16 / fp16 1e-2 (the kernels round
h and the output to 16 bits). Bit-exact: float64 (the reference runs), and a token's output row
whatever the other tokens of the launch (same launch configuration)."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels import moe as kernels
from kdtree_engine.model.moe import MoE
from kdtree_engine.model.testing import tiny_config
from kdtree_engine.ref.moe import moe_experts_ref, shared_expert_ref


def make_inputs(n, k, n_experts, hidden, inter, inter_s, dtype, seed):
    """x [n, H], weights [n, k] float32, ids [n, k] (distinct per row),
    w_gate_up [E, 2I, H], w_down [E, H, I], shared (w_gate [Is, H], w_up [Is, H], w_down [H, Is]) or
    None when inter_s is 0; weights N(0, 1/fan_in), cast to dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    ids = torch.rand(n, n_experts, generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(n, k, generator=gen) * 2.5

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    shared = (w(inter_s, hidden), w(inter_s, hidden), w(hidden, inter_s)) if inter_s else None
    return x, weights, ids, w(n_experts, 2 * inter, hidden), w(n_experts, hidden, inter), shared


def to(inputs, device=None, dtype=None):
    """The inputs on device; the float tensors (not weights, ids) in dtype when given."""
    x, weights, ids, w_gate_up, w_down, shared = inputs

    def f(t):
        return t.to(device=device, dtype=dtype)

    moved = (f(x), weights.to(device), ids.to(device), f(w_gate_up), f(w_down))
    return (*moved, None if shared is None else tuple(f(t) for t in shared))


CASES = [  # (n, k, E, H, I, Is)
    (1, 1, 4, 16, 16, 16),  # n = 1, k = 1
    (1, 6, 32, 40, 24, 24),  # decode, scaled-down Kimi's E and k; H, I not multiples of 16
    (5, 2, 8, 64, 32, 64),  # Is = 2 I (two shared experts): the shared tiles use more columns
    (18, 2, 4, 32, 40, 24),  # Is < I; two shared tiles, the second partial
    (33, 6, 32, 48, 32, 32),  # a verify of 33 nodes: 198 assignments, BLOCK_M 16
    (50, 3, 8, 24, 40, 40),  # BLOCK_M 32
    (70, 2, 4, 40, 16, 48),  # BLOCK_M 64
    (9, 3, 6, 32, 24, 0),  # no shared expert
]


def check(case, dtype, device, seed=0):
    inputs = make_inputs(*case, dtype, seed)
    got = kernels.moe_experts(*to(inputs, device))
    n, hidden = case[0], case[3]
    assert got.dtype == dtype and got.shape == (n, hidden)
    exact = moe_experts_ref(*to(inputs, dtype=torch.float32))
    scale = float(exact.abs().max())
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu().float(), exact, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_with_shared_expert_matches_reference(case, dtype, device):
    check(case, dtype, device)


def test_kernel_with_shared_expert_float16(device):
    check((12, 2, 4, 32, 24, 32), torch.float16, device)


def test_float64_runs_the_reference(device):
    inputs = to(make_inputs(6, 2, 4, 24, 16, 16, torch.float64, 3), device)
    assert torch.equal(kernels.moe_experts(*inputs), moe_experts_ref(*inputs))


def test_ref_shared_is_the_model_mlp_added_last():
    """moe_experts_ref with `shared` = the routed reference + model.moe.MLP's output, in x's dtype."""
    c = tiny_config()
    layer = MoE(c).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(7, c.hidden_size).bfloat16()
    weights, ids = layer.gate(x, "ref")
    routed = layer.experts.gate_up_proj, layer.experts.down_proj
    want = moe_experts_ref(x, weights, ids, *routed) + layer.shared_experts(x)
    assert torch.equal(moe_experts_ref(x, weights, ids, *routed, layer.shared_weights()), want)
    assert torch.equal(shared_expert_ref(x, layer.shared_weights()), layer.shared_experts(x))


def test_rejects_bad_shared_weights():
    x, weights, ids, w_gate_up, w_down, (g, u, d) = make_inputs(2, 2, 4, 16, 8, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="shared"):
        moe_experts_ref(x, weights, ids, w_gate_up, w_down, (g, u, d[:, :4]))
    with pytest.raises(ValueError, match="shared"):
        moe_experts_ref(x, weights, ids, w_gate_up, w_down, (g, u.bfloat16(), d))


@pytest.mark.parametrize("shared", [24, 0])
def test_token_rows_do_not_depend_on_the_batch(shared, device):
    """A token's output row in a launch of 33 tokens (198 assignments) is the same bits as the token
    alone (6 assignments): one launch configuration (BLOCK_M 16), per-row dot products, a fixed-order
    combine."""
    inputs = to(make_inputs(33, 6, 32, 48, 24, shared, torch.bfloat16, 11), device)
    x, weights, ids, w_gate_up, w_down, shared_w = inputs
    assert kernels.launch_config(33 * 6, 32, 2).block_m == kernels.launch_config(6, 32, 2).block_m
    batch = kernels.moe_experts(*inputs)
    for i in (0, 17, 32):
        row = slice(i, i + 1)
        one = kernels.moe_experts(x[row], weights[row], ids[row], w_gate_up, w_down, shared_w)
        assert torch.equal(one[0], batch[i]), i


def test_makes_no_host_sync(device, monkeypatch):
    """No Tensor -> Python value conversion on the host (item, tolist, bool, int, float, nonzero)."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync")

    inputs = to(make_inputs(9, 2, 4, 32, 16, 16, torch.float32, 7), device)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = kernels.moe_experts(*inputs)
    monkeypatch.undo()
    want = moe_experts_ref(*to(inputs, "cpu"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def random_layer(dtype: torch.dtype, **overrides) -> MoE:
    layer = MoE(tiny_config(**overrides))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters()):
            if p.numel():  # n_shared_experts = 0: an empty MLP
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=gen)
    return layer.to(dtype)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("n_shared", [1, 2, 0])
def test_model_moe_triton_equals_ref(n_shared, device):
    """model.moe.MoE with impl="triton" against impl="ref" in float32 (same routing: same router)."""
    layer = random_layer(torch.float32, n_shared_experts=n_shared).to(device)
    x = torch.randn(2, 9, layer.c.hidden_size).to(device)
    with torch.no_grad():
        want, got = layer(x, "ref"), layer(x, "triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


KIMI_SMALL = dict(n_experts=32, k=6, hidden=2048, inter=768, inter_s=768)  # bench e2e's scaled-down Kimi


def realistic(n: int, seed: int):
    s = KIMI_SMALL
    args = (n, s["k"], s["n_experts"], s["hidden"], s["inter"], s["inter_s"], torch.bfloat16, seed)
    return to(make_inputs(*args), "cuda")


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("n", [1, 33, 64 * 33])
def test_realistic_shape_bf16(n):
    inputs = realistic(n, n)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = kernels.moe_experts(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = moe_experts_ref(*to(inputs, dtype=torch.float32))
    scale = float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * scale)
    assert torch.equal(got, kernels.moe_experts(*inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 33])
def test_cuda_graph_replay(n):
    """Captured once on static inputs; replays after copying other x / weights / ids into them equal
    eager calls on the same inputs."""
    static = realistic(n, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        kernels.moe_experts(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(*static)
    for seed in (1, 2):
        for dst, src in zip(static[:3], realistic(n, seed)[:3]):  # x, weights, ids; the expert weights stay
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kernels.moe_experts(*static))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [33, 150])
def test_realistic_token_rows_do_not_depend_on_the_batch(n):
    """Every token's row of a launch of n tokens equals the token alone, bit for bit (BLOCK_M 16 at 33
    tokens, 32 at 150: mma.sync tiles, the same BLOCK_N / BLOCK_K as one token)."""
    s = KIMI_SMALL
    assert kernels.launch_config(n * s["k"], s["n_experts"], 2).block_m == (16 if n < 50 else 32)
    x, weights, ids, w_gate_up, w_down, shared = realistic(n, 4)
    batch = kernels.moe_experts(x, weights, ids, w_gate_up, w_down, shared)
    for i in range(n):
        row = slice(i, i + 1)
        one = kernels.moe_experts(x[row], weights[row], ids[row], w_gate_up, w_down, shared)
        assert torch.equal(one[0], batch[i]), f"token {i} of {n}"
