"""Dense MLP and the sigmoid-routed mixture of experts, HF parameter names.

The routed experts are stored stacked, as transformers keeps them in memory: `experts.gate_up_proj`
[E, 2I, H] (rows 0..I-1 expert e's gate_proj.weight, rows I..2I-1 its up_proj.weight) and
`experts.down_proj` [E, H, I]. The loader stacks the per-expert tensors of checkpoints on disk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdtree_engine.impl import resolve_impl
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.linear import gemm_mode, project
from kdtree_engine.ref.moe import Shared, moe_experts_ref


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, impl: str | None = "ref", invariant: bool = False) -> torch.Tensor:
        """impl: accepted for the model's uniform layer call; the SiLU is a torch op, the three GEMMs as the
        kernel path's projections (model.linear.gemm_mode: row-invariant when `invariant`)."""
        gemm = gemm_mode(resolve_impl(impl, x.device) == "triton", invariant, x.device)
        h = F.silu(project(x, self.gate_proj, gemm)) * project(x, self.up_proj, gemm)
        return project(h, self.down_proj, gemm)


class Router(nn.Module):
    """`gate`: weight [n_experts, hidden] and e_score_correction_bias [n_experts], both kept float32 whatever
    the model dtype (as transformers' _keep_in_fp32_modules_strict); the scores are computed in float32."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))

    def _apply(self, fn, recurse=True):
        weight, bias = self.weight.data, self.e_score_correction_bias
        super()._apply(fn, recurse)
        self.weight.data = weight.to(device=self.weight.device, dtype=torch.float32)
        self.e_score_correction_bias = bias.to(device=self.weight.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor, impl: str | None = "ref") -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] float32, expert ids [n, k] int64). Device ops only; a kernel
        impl runs two launches, the matmul in fixed chunks of hidden (x widened as it is read; a row's
        logits do not depend on the other rows, and differ from F.linear's in the last bits) and
        everything after it (ties: the smaller id first, ids in descending score order; the torch ops
        leave the order open)."""
        c = self.c
        if resolve_impl(impl, x.device) == "triton":
            from kdtree_engine.kernels.moe_router import route_hidden  # imported lazily: triton is optional

            return route_hidden(x, self.weight, self.e_score_correction_bias, n_group=c.n_group,
                                topk_group=c.topk_group, top_k=c.num_experts_per_tok,
                                norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)  # fmt: skip
        logits = F.linear(x.float(), self.weight.float())  # [n, E]
        scores = logits.sigmoid()  # [n, E]
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)  # [n, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, G]
        keep_groups = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices  # [n, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, c.n_routed_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices  # [n, k]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class Experts(nn.Module):
    """The routed experts, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        e, i, h = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x, weights, ids, impl: str | None = "ref") -> torch.Tensor:
        """x [n, hidden], weights/ids [n, k] -> [n, hidden]: sum over k of weight * expert(x). "ref" runs
        a loop over the experts in use (as transformers, one host sync); "triton" the grouped kernels
        (no host sync, capturable)."""
        if resolve_impl(impl, x.device) == "triton":
            from kdtree_engine.kernels.moe import moe_experts  # imported lazily: triton is optional

            return moe_experts(x, weights, ids, self.gate_up_proj, self.down_proj)
        return moe_experts_ref(x, weights, ids, self.gate_up_proj, self.down_proj)


class MoE(nn.Module):
    """Routed experts (`experts.gate_up_proj`, `experts.down_proj`), `gate` router, `shared_experts` MLP."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.experts = Experts(c)
        self.gate = Router(c)
        self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

    def shared_weights(self) -> Shared | None:
        """The shared expert as (gate_proj.weight [Is, H], up_proj.weight [Is, H], down_proj.weight
        [H, Is]), None without one (n_shared_experts = 0)."""
        mlp = self.shared_experts
        if mlp.gate_proj.weight.shape[0] == 0:
            return None
        return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight

    def forward(self, x: torch.Tensor, impl: str | None = "ref", invariant: bool = False) -> torch.Tensor:
        """x [b, t, hidden] -> [b, t, hidden]. "triton": six launches, the router's two, then the routed
        and shared experts in the four of kernels.moe (one rounding of their sum; `invariant`: one
        launch shape at every size); "ref": the torch reference, routed then shared, each rounded to the
        model dtype."""
        flat = x.reshape(-1, x.shape[-1])  # [n, hidden]
        weights, ids = self.gate(flat, impl)
        if resolve_impl(impl, x.device) == "triton":
            from kdtree_engine.kernels.moe import moe_experts  # imported lazily: triton is optional

            routed = self.experts.gate_up_proj, self.experts.down_proj
            return moe_experts(
                flat, weights, ids, *routed, self.shared_weights(), invariant=invariant
            ).view_as(x)
        return self.experts(flat, weights, ids, impl).view_as(x) + self.shared_experts(x)
