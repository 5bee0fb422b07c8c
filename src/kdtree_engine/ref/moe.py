"""Reference routed experts of the mixture of experts, on stacked expert weights.

`moe_experts_ref` is the specification of kernels.moe.moe_experts. It runs the operations of
model.moe.MoE.routed one for one (the same grouping, order, dtypes and accumulation), so given the
same weights it returns the same bits; the weights of the E experts are stacked:

    w_gate_up [E, 2I, H]   rows 0..I-1: gate_proj.weight, rows I..2I-1: up_proj.weight of expert e
    w_down    [E, H, I]    down_proj.weight of expert e

It loops over the experts on the host (one sync for the per-expert counts): it is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_moe_args(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Validates shapes and dtypes (metadata only, no device sync); returns (n, k, E, H, I)."""
    if x.dim() != 2 or weights.dim() != 2 or ids.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("moe: expected x [n, H], weights/ids [n, k], w_gate_up [E, 2I, H], w_down [E, H, I]")
    n, hidden = x.shape
    n_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    if weights.shape != ids.shape or ids.shape[0] != n:
        raise ValueError(f"moe: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must be [{n}, k]")
    if two_inter % 2 or w_gate_up.shape[2] != hidden or tuple(w_down.shape) != (n_experts, hidden, inter):
        raise ValueError(
            f"moe: w_gate_up {tuple(w_gate_up.shape)} / w_down {tuple(w_down.shape)} do not match "
            f"[E, 2I, {hidden}] / [E, {hidden}, I]"
        )
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"moe: expert weights must have x's dtype {x.dtype}")
    if weights.dtype != torch.float32 or ids.dtype != torch.int64:
        raise ValueError(f"moe: expected float32 weights and int64 ids, got {weights.dtype}, {ids.dtype}")
    return n, ids.shape[1], n_experts, hidden, inter


def moe_experts_ref(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """x [n, H], weights [n, k] float32 (already scaled), ids [n, k] int64 in 0..E-1 -> [n, H] in x's
    dtype: for every token, the sum over its k choices of weight * down(silu(gate(x)) * up(x)).

    The assignments (token, slot) are grouped by expert with a stable argsort of ids.flatten(); the
    experts run in increasing id order, each on its tokens at once; an expert's output (x's dtype)
    times the float32 weight promotes to float32, is cast back to x's dtype and index_add_-ed into
    zeros_like(x), as model.moe.MoE.routed does."""
    _, k, n_experts, _, inter = check_moe_args(x, weights, ids, w_gate_up, w_down)
    order = ids.flatten().argsort(stable=True)  # [n * k] assignment slots grouped by expert
    counts = torch.bincount(ids.flatten(), minlength=n_experts).tolist()
    out = torch.zeros_like(x)
    begin = 0
    for e, count in enumerate(counts):
        if count:
            chosen = order[begin : begin + count]
            token, slot = chosen // k, chosen % k
            x_tok = x[token]
            h = F.silu(F.linear(x_tok, w_gate_up[e, :inter])) * F.linear(x_tok, w_gate_up[e, inter:])
            y = F.linear(h, w_down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        begin += count
    return out
