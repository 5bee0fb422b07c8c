"""Multi-head latent attention (MLA) on the latent cache, absorbed form, Hugging Face parameter names.

Per token: c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:r]) and the roped k_pe go to the cache
(r + d_r values); the query is absorbed, q_abs = [q_nope @ W_UK, roped q_pe], so attention works on
the latent rows directly, and the latent output o is lifted by W_UV before o_proj.

On the kernel path (float32 / bf16 / fp16, see MLAttention.forward) a layer's latent row is normed,
roped and written into the cache in one launch (kernels/mla_latent.py), and the absorbed query is
written in place into one buffer (the W_UK GEMM into its first r columns, the rope kernel into its last
d_r): no cat, no index_put. The two projections that read x (q_a_proj or q_proj, and
kv_a_proj_with_mqa) run as one GEMM on a fused weight whose rows the two parameters are views of
(packed at the first kernel-path call, as drafter/packed.py does for the drafter). "ref" keeps the
torch ops below, the specification.
"""

from __future__ import annotations

import torch
from torch import nn

from kdtree_engine.impl import capturing, resolve_impl
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.context import ForwardContext
from kdtree_engine.model.linear import Gemm, linear, per_head_into, project
from kdtree_engine.model.rope import apply_rope
from kdtree_engine.packing import intact, pack_rows


class RMSNorm(nn.Module):
    """As transformers' DeepseekV3RMSNorm: statistics in float32, cast back, then times the weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, impl: str | None = "ref") -> torch.Tensor:
        """impl: "ref" (torch ops, the default for callers outside the model) or a kernel impl (one launch,
        for float32 / bf16 / fp16 with the weight in x's dtype)."""
        if x.dtype == self.weight.dtype != torch.float64 and resolve_impl(impl, x.device) == "triton":
            from kdtree_engine.kernels.rmsnorm import rmsnorm  # imported lazily: triton is optional

            return rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, impl: str | None = "ref"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: x, delta [..., dim] (delta None: nothing to add) -> (x + delta,
        norm(x + delta)). A kernel impl does both in one launch (kernels/rmsnorm.add_rmsnorm), with the
        bits of the add then the RMSNorm kernel."""
        if delta is None:
            return x, self(x, impl)
        if (
            x.dtype == delta.dtype == self.weight.dtype != torch.float64
            and resolve_impl(impl, x.device) == "triton"
        ):
            from kdtree_engine.kernels.rmsnorm import add_rmsnorm

            return add_rmsnorm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x, impl)


class MLAttention(nn.Module):
    """One layer's MLA. Parameters as in HF checkpoints: q_proj or q_a_proj/q_a_layernorm/q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj ([h * (d_nope + d_v), r]), o_proj."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        h, dq, bias = c.num_attention_heads, c.qk_head_dim, c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, h * dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=bias)
        self._fused_a: tuple | None = None  # (weight, bias or None, pointers): see _a_proj

    def _a_proj(self, x: torch.Tensor, gemm: Gemm = "torch") -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel path's one GEMM for the projections that read x: (q_a [b, t, q_lora_rank], or q
        [b, t, h * qk_head_dim] without q_lora, and kv_a [b, t, r + d_r]), views of one output. The fused
        weight is packed at the first call and again whenever a parameter no longer points into it."""
        first = self.q_proj if self.c.q_lora_rank is None else self.q_a_proj
        kv = self.kv_a_proj_with_mqa
        if (first.bias is None) != (kv.bias is None):  # q_proj has no bias: two GEMMs then
            return project(x, first, gemm), project(x, kv, gemm)
        if self._fused_a is None or not intact(self._fused_a[2]):
            if capturing(x.device):  # a captured copy would re-read freed storage on replay
                raise RuntimeError(
                    "model: its kernel path packs the attention projections at its first call; run one "
                    "eager forward (after any .to()) before capturing it in a CUDA graph"
                )
            ptrs: list = []
            w = pack_rows([[first.weight, kv.weight]], ptrs)[0]
            b = None if kv.bias is None else pack_rows([[first.bias, kv.bias]], ptrs)[0]
            self._fused_a = (w, b, tuple(ptrs))
        w, b, _ = self._fused_a
        return linear(x, w, b, gemm).split([first.weight.shape[0], kv.weight.shape[0]], dim=-1)

    def _query(self, x: torch.Tensor, impl: str | None = "ref") -> torch.Tensor:
        """x [b, t, hidden] -> q [b, t, h, qk_head_dim]."""
        if self.c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x), impl))
        return q.view(*x.shape[:2], self.c.num_attention_heads, self.c.qk_head_dim)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, d_nope, r] and W_UV [h, d_v, r], views of kv_b_proj.weight."""
        c = self.c
        w = self.kv_b_proj.weight.view(
            c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def latent_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl="ref") -> torch.Tensor:
        """x [b, t, hidden] -> cache rows [b, t, r + d_r]: normalized c_kv then roped k_pe."""
        c = self.c
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe, cos, sin, c.rope_interleave, impl)  # [b, t, d_r]
        return torch.cat([self.kv_a_layernorm(c_kv, impl), k_pe], dim=-1)

    def absorbed_query(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl="ref"
    ) -> torch.Tensor:
        """x [b, t, hidden] -> q_abs [b, t, h, r + d_r] = [q_nope @ W_UK, roped q_pe]."""
        c = self.c
        q_nope, q_pe = self._query(x, impl).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w_uk, _ = self._w_uk_uv()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # [b, t, h, r]
        return torch.cat([q_lat, apply_rope(q_pe, cos, sin, c.rope_interleave, impl)], dim=-1)

    def _kernels_apply(self, x: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether the fused kernel path runs: a kernel impl, float32 / bf16 / fp16 activations, weights
        and cos / sin of one dtype, d_r / 2 a power of two."""
        half = self.c.qk_rope_head_dim // 2
        w = self.kv_a_layernorm.weight
        return (ctx.kernels and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and x.dtype == w.dtype == ctx.cos.dtype and half & (half - 1) == 0)  # fmt: skip

    def _write_latent(self, kv_a: torch.Tensor, kv_layer, ctx: ForwardContext) -> None:
        """The kernel path's cache write: norm + rope + row store of kv_a [b, t, r + d_r] in one launch."""
        from kdtree_engine.kernels.mla_latent import latent_write

        norm, c = self.kv_a_layernorm, self.c
        latent_write(kv_a, norm.weight, norm.eps, ctx.cos, ctx.sin, c.rope_interleave, kv_layer, ctx.start)

    def _absorbed_query_into(
        self, q_a: torch.Tensor, ctx: ForwardContext, dtype: torch.dtype
    ) -> torch.Tensor:
        """The kernel path's absorbed query [b, t, h, r + d_r] in `dtype` from q_a (q_a_proj's output, or
        q_proj's without q_lora), written in place: W_UK's GEMM into the first r columns, the rope kernel
        into the last d_r."""
        from kdtree_engine.kernels.rope import apply_rope as rope_kernel

        c, (b, t, _) = self.c, q_a.shape
        h, r, d_nope = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim
        gemm = ctx.gemm
        if c.q_lora_rank is not None:
            q_a = project(self.q_a_layernorm(q_a, "triton"), self.q_b_proj, gemm)
        q = q_a.view(b, t, h, c.qk_head_dim)
        out = torch.empty(b, t, h, r + c.qk_rope_head_dim, dtype=dtype, device=q.device)
        w_uk, _ = self._w_uk_uv()
        q_nope = q.reshape(b * t, h, -1)[..., :d_nope].transpose(0, 1)  # [h, b * t, d_nope]
        per_head_into(q_nope, w_uk, out.view(b * t, h, -1)[..., :r].transpose(0, 1), gemm)  # [h, b t, r]
        rope_kernel(q[..., d_nope:], ctx.cos, ctx.sin, c.rope_interleave, out=out[..., r:])
        return out

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [b, t, hidden]; kv_layer [b, max_len, r + d_r] (written in place at start[b] + 0..t-1)
        -> [b, t, hidden]."""
        b, t, _ = x.shape
        cos, sin = ctx.cos, ctx.sin
        kernels = self._kernels_apply(x, ctx) and kv_layer.dtype == x.dtype
        if kernels:
            q_a, kv_a = self._a_proj(x, ctx.gemm)
            self._write_latent(kv_a, kv_layer, ctx)
            q = self._absorbed_query_into(q_a, ctx, kv_layer.dtype)  # [b, t, h, r + d_r]
        else:
            kv_layer[ctx.rows, ctx.slots] = self.latent_rows(x, cos, sin, ctx.op_impl).to(kv_layer.dtype)
            q = self.absorbed_query(x, cos, sin, ctx.op_impl).to(kv_layer.dtype)  # [b, t, h, r + d_r]
        out = ctx.attend(q, kv_layer)  # [b, t, h, r]
        _, w_uv = self._w_uk_uv()
        gemm = ctx.gemm if kernels else "torch"
        if kernels:  # the value lift per head, written in place into v's [b, t, h, d_v] rows (the einsum's
            # [h, b t, d_v] result costs a copy before o_proj at t > 1); row-invariant GEMMs in that mode
            c = self.c
            v = torch.empty(b, t, c.num_attention_heads, c.v_head_dim, dtype=x.dtype, device=x.device)
            lat = out.to(x.dtype).reshape(b * t, c.num_attention_heads, -1).transpose(0, 1)  # [h, b t, r]
            per_head_into(
                lat, w_uv.transpose(1, 2), v.view(b * t, c.num_attention_heads, -1).transpose(0, 1), gemm
            )
        else:  # the reference path (autograd too: training)
            v = torch.einsum("bthr,hdr->bthd", out.to(x.dtype), w_uv)  # [b, t, h, d_v]
        return project(v.reshape(b, t, -1), self.o_proj, gemm)
