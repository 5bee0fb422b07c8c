"""Dense MLP and the sigmoid-routed mixture of experts, HF parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdtree_engine.model.config import ModelConfig


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] float32, expert ids [n, k] int64)."""
        c = self.c
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [n, E]
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


class MoE(nn.Module):
    """Routed experts (`experts.{e}.{gate,up,down}_proj`), `gate` router, `shared_experts` MLP."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.experts = nn.ModuleList(
            MLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts)
        )
        self.gate = Router(c)
        self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [n, hidden], weights/ids [n, k] -> [n, hidden]: sum over k of weight * expert(x), experts
        added in id order (as transformers). Assignments are sorted by expert once, so the loop needs
        a single host sync (the per-expert counts)."""
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)  # [n * k] assignment slots grouped by expert
        counts = torch.bincount(ids.flatten(), minlength=self.c.n_routed_experts).tolist()
        out = torch.zeros_like(x)
        begin = 0
        for e, count in enumerate(counts):
            if count:
                chosen = order[begin : begin + count]
                token, slot = chosen // k, chosen % k
                y = self.experts[e](x[token]) * weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
            begin += count
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, t, hidden] -> [b, t, hidden]."""
        flat = x.reshape(-1, x.shape[-1])  # [n, hidden]
        weights, ids = self.gate(flat)
        return self.routed(flat, weights, ids).view_as(x) + self.shared_experts(x)
