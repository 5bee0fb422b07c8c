"""One GPU's share of a Kimi-K2 decoder layer and of its DFlash drafter, with random bf16 weights, for
`kdtree-engine bench kimi` (bench/kimi.py times them on the GPU; the tests run them on the CPU at
small shapes).

The shape is the published Kimi-K2 config (`KIMI_K2`: hidden 7168, MLA with q_lora 1536 and a latent
cache of 512 + 64 per token, 384 routed experts of width 2048, top-8, one shared expert, 61 layers,
vocabulary 163840) served on 8 GPUs as SGLang serves it with tensor-parallel attention and
expert-parallel MoE (`Shard`, tp = ep = 8):

- `AttentionShard`: the layer's input RMSNorm and MLA with 64 / tp heads (q_b_proj and kv_b_proj cut by
  heads, o_proj by its input; q_a_proj and kv_a_proj_with_mqa whole), the model's own module
  (model/mla.py) on one layer's latent cache, its output this GPU's partial sum before the all-reduce;
- `MoEShard`: the post-attention RMSNorm, the router over all 384 experts (replicated), this rank's
  384 / ep experts (the others' choices -1, kernels/moe.py) and its 1 / tp slice of the shared expert's
  width, its output again a partial sum;
- `lm_head_shard`: the rank's 163840 / tp rows of the vocabulary projection;
- `drafter_shard`: the z-lab Kimi-K2.5 DFlash drafter's shape (6 Qwen3-style layers of hidden 7168, 64
  query and 8 KV heads of 128, MLP 18432, block 8) with heads and MLP width cut by tp, and a chosen
  number of layers (the bench times 1 and 2 and takes the difference as one layer). Its `fc` reads one
  target layer's features (7168 inputs) where the real one reads six (43008, of which a tensor-parallel
  rank reads 5376): 1.33x the bytes of a rank's share.

Routing is given (bench/kimi_routing.py) rather than taken from random router weights: the router
still runs, and its ids are mapped to the rank's view, then replaced by the given ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from kdtree_engine.bench.kimi_routing import ExpertGrid, local_ids
from kdtree_engine.impl import resolve_impl
from kdtree_engine.model import rope
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.context import ForwardContext
from kdtree_engine.model.mla import MLAttention, RMSNorm
from kdtree_engine.model.moe import Router
from kdtree_engine.ref.moe import moe_experts_ref

KIMI_K2 = ModelConfig(  # moonshotai/Kimi-K2-Instruct config.json
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    rope_theta=50000.0,
    rope_type="yarn",
    rope_factor=32.0,
    rope_original_max_position_embeddings=4096,
    rope_beta_fast=1.0,
    rope_beta_slow=1.0,
    rope_mscale=1.0,
    rope_mscale_all_dim=1.0,
    max_position_embeddings=131072,
)


@dataclass(frozen=True)
class DrafterShape:
    """The z-lab Kimi-K2.5 DFlash drafter (its published config)."""

    layers: int = 6
    hidden: int = 7168
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 18432
    block: int = 8


@dataclass(frozen=True)
class Shard:
    """How the model is split over the GPUs: attention and the shared expert over tp ranks (heads,
    widths), the routed experts over ep ranks; `model` and `drafter` the shapes split."""

    tp: int = 8
    ep: int = 8
    model: ModelConfig = KIMI_K2
    drafter: DrafterShape = DrafterShape()

    def __post_init__(self) -> None:
        c, d = self.model, self.drafter
        cuts = {
            "heads": c.num_attention_heads,
            "shared width": c.moe_intermediate_size * c.n_shared_experts,
            "vocabulary": c.vocab_size,
            "drafter kv heads": d.kv_heads,
            "drafter MLP": d.intermediate,
        }
        for name, size in cuts.items():
            if self.tp < 1 or size % self.tp:
                raise ValueError(f"Shard.tp: {self.tp} does not divide the {name} ({size})")
        ExpertGrid(c.n_routed_experts, c.num_experts_per_tok, self.ep)  # checks ep

    @property
    def attention_config(self) -> ModelConfig:
        return self.model.replace(num_attention_heads=self.model.num_attention_heads // self.tp)

    @property
    def experts(self) -> ExpertGrid:
        return ExpertGrid(self.model.n_routed_experts, self.model.num_experts_per_tok, self.ep)

    @property
    def shared_width(self) -> int:
        return self.model.moe_intermediate_size * self.model.n_shared_experts // self.tp

    @property
    def vocab(self) -> int:
        return self.model.vocab_size // self.tp


def randomize_(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter N(0, 1 / fan_in) (norm weights 1): random weights at the scale of a trained
    layer's, so that activations stay finite through the layer. Gradients off: the bench only runs
    forwards."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return module.requires_grad_(False)


class AttentionShard(nn.Module):
    """input_layernorm + MLA with this GPU's heads: x [b, t, hidden] -> its share of the attention
    output [b, t, hidden] (module docstring)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAttention(c)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x, ctx.op_impl), kv_layer, ctx)

    def context(
        self, b: int, t: int, prefix: int, visibility: torch.Tensor, impl: str | None, invariant: bool = False
    ) -> ForwardContext:
        """The forward context of t new tokens per request on `prefix` cached rows (validate=False: no
        host read, as a captured forward; invariant: the row-invariant mode, issue 32); its attention
        plan is built by the first call."""
        dev, dtype = self.input_layernorm.weight.device, self.input_layernorm.weight.dtype
        start = torch.full((b,), prefix, dtype=torch.int64, device=dev)
        positions = start[:, None] + torch.arange(t, device=dev)
        cos, sin = rope.cos_sin(self.c, rope.inv_freq(self.c).to(dev), positions, dtype)
        return ForwardContext(self.c, impl, start, t, visibility.to(dev), cos, sin, False, invariant)


class MoEShard(nn.Module):
    """post_attention_layernorm, the whole router, this rank's routed experts and shared-expert slice:
    x [b, t, hidden] -> its share of the MoE output [b, t, hidden]."""

    def __init__(self, shard: Shard, rank: int) -> None:
        super().__init__()
        c, grid = shard.model, shard.experts
        self.c, self.grid, self.rank = c, grid, rank
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate = Router(c)
        i, h, e = c.moe_intermediate_size, c.hidden_size, grid.per_rank
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        s = shard.shared_width
        self.shared_gate = nn.Parameter(torch.empty(s, h))
        self.shared_up = nn.Parameter(torch.empty(s, h))
        self.shared_down = nn.Parameter(torch.empty(h, s))

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's view (its experts from 0, the others -1), on the device."""
        return local_ids(ids, self.grid, self.rank)

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        impl: str | None,
        invariant: bool = False,
    ) -> torch.Tensor:
        """weights [n, k] float32 and ids [n, k] int64 (global): the routing to apply (the router's own
        output is computed and mapped, then replaced: module docstring); invariant: the experts' one
        launch shape of the row-invariant mode."""
        h = self.post_attention_layernorm(x, impl).reshape(-1, x.shape[-1])
        self.local(self.gate(h, impl)[1])
        shared = (self.shared_gate, self.shared_up, self.shared_down)
        routed = (h, weights, self.local(ids), self.gate_up_proj, self.down_proj, shared)
        if resolve_impl(impl, h.device) != "triton":
            return moe_experts_ref(*routed).view_as(x)
        from kdtree_engine.kernels.moe import moe_experts  # imported lazily: triton is optional

        return moe_experts(*routed, invariant=invariant).view_as(x)


def lm_head_shard(shard: Shard) -> nn.Linear:
    """This rank's rows of the vocabulary projection."""
    return nn.Linear(shard.model.hidden_size, shard.vocab, bias=False)


def drafter_shard(shard: Shard, layers: int):
    """(drafter, stand-in target with embed_tokens and lm_head) for this GPU's share of the drafter with
    `layers` layers; the vocabulary is the rank's shard, the mask token its last id."""
    from kdtree_engine.drafter.config import DFlashConfig
    from kdtree_engine.drafter.model import DFlashDrafter

    d, tp = shard.drafter, shard.tp
    config = DFlashConfig(
        vocab_size=shard.vocab,
        hidden_size=d.hidden,
        intermediate_size=d.intermediate // tp,
        num_hidden_layers=layers,
        num_attention_heads=d.heads // tp,
        num_key_value_heads=d.kv_heads // tp,
        head_dim=d.head_dim,
        block_size=d.block,
        target_layer_ids=(1,),
        mask_token_id=shard.vocab - 1,
        num_target_layers=shard.model.num_hidden_layers,
    )
    head = nn.Linear(d.hidden, shard.vocab, bias=False)  # the target's lm_head rows: the drafter has none
    target = SimpleNamespace(embed_tokens=nn.Embedding(shard.vocab, d.hidden), lm_head=head)
    return DFlashDrafter(config), target


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def attention_bytes(part: AttentionShard, b: int, t: int, prefix: int) -> int:
    """What the attention share must move: its weights, the cache rows read (prefix + t per request)
    and written (t), the layer input read and the output written."""
    c, item = part.c, part.input_layernorm.weight.element_size()
    cache = b * (prefix + 2 * t) * c.latent_dim * item
    return parameter_bytes(part) + cache + 2 * b * t * c.hidden_size * item


def moe_bytes(part: MoEShard, rows: int, experts_touched: int) -> int:
    """What the MoE share must move: the norm, the router (float32), the touched experts of this rank,
    the shared slice, the input read and the output written."""
    item = part.gate_up_proj.element_size()
    expert = (part.gate_up_proj[0].numel() + part.down_proj[0].numel()) * item
    fixed = parameter_bytes(part) - part.gate_up_proj.numel() * item - part.down_proj.numel() * item
    return fixed + experts_touched * expert + 2 * rows * part.c.hidden_size * item


def lm_head_bytes(head: nn.Linear, rows: int) -> int:
    """The vocabulary rows, the hidden states read and the logits written (in the weight's dtype)."""
    item = head.weight.element_size()
    return parameter_bytes(head) + rows * (head.in_features + head.out_features) * item
