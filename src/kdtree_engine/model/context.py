"""What one target forward resolves once and every layer reads (as nano-vllm's per-forward Context):
the implementation, the rope tables of the new tokens' positions, where their rows go in the cache,
their visibility, and the attention plan, built at the first layer's call and reused by the others."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kdtree_engine.attention import AttentionPlan, plan_attention
from kdtree_engine.impl import resolve_impl
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.linear import Gemm, gemm_mode


@dataclass
class ForwardContext:
    """One forward's shared state.

    config: the model's; impl: as the forward was given it ("ref", "triton", "hopper" or None; the
    attention reads it, as it has a Hopper kernel of its own); start [b] int64: cached rows before the
    forward (the new rows go to start[b] .. start[b] + t - 1); t: new tokens per request; visibility
    [b, t, t] bool among them (None: causal); cos / sin [b, t, d_r / 2] in the activations' dtype;
    validate: False keeps every host read out (CUDA graph capture; the Hopper schedule is then computed
    on the device); invariant: on the kernel path, every op computes a token's row with an order that
    does not depend on the rest of the launch (the forward's `row_invariant`; issue 32); rows_hint: the
    cache's (LatentKVCache.rows_hint), the plan's length hint with the forward's t added.
    """

    config: ModelConfig
    impl: str | None
    start: torch.Tensor
    t: int
    visibility: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    validate: bool = True
    invariant: bool = False
    rows_hint: int | None = None
    plan: AttentionPlan | None = field(default=None, init=False)

    @functools.cached_property
    def kernels(self) -> bool:
        """Whether the ops without a Hopper kernel of their own run their Triton kernels (impl resolved
        once for the forward: kdtree_engine.impl.resolve_impl)."""
        return resolve_impl(self.impl, self.start.device) == "triton"

    @property
    def row_invariant(self) -> bool:
        """Whether this forward's kernels run row-invariant: asked for, and on the kernel path."""
        return self.invariant and self.kernels

    @functools.cached_property
    def gemm(self) -> Gemm:
        """The projections' GEMMs (model.linear.gemm_mode): torch's, the small-M kernel, row-invariant."""
        return gemm_mode(self.kernels, self.invariant, self.start.device)

    @property
    def op_impl(self) -> str:
        """The impl the norms, rope and MoE take: "triton" or "ref"."""
        return "triton" if self.kernels else "ref"

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """[b, 1] int64 request index, for the reference path's index_put (built on first use: the kernel
        path writes the cache without it)."""
        return torch.arange(self.start.shape[0], device=self.start.device)[:, None]

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """[b, t] int64 cache rows written."""
        return self.start[:, None] + torch.arange(self.t, device=self.start.device)

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """q [b, t, h, r + d_r], kv_layer [b, max_len, r + d_r] -> latent output [b, t, h, r]."""
        if self.plan is None:
            c = self.config
            hint = self.rows_hint + self.t if self.rows_hint else None
            self.plan = plan_attention(q, kv_layer, self.start + self.t, softmax_scale=c.softmax_scale,
                                       d_v=c.kv_lora_rank, visibility=self.visibility, impl=self.impl,
                                       validate=self.validate, invariant=self.row_invariant,
                                       length_hint=hint)  # fmt: skip
        return self.plan.run(q, kv_layer)[0]
