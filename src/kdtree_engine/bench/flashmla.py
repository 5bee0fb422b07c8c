"""FlashMLA as a peer of `bench attention` (issue 29), when its package is importable (PyPI
`sgl-flash-mla`, a maintained FlashMLA fork; never a dependency of kdtree-engine).

FlashMLA's dense bf16 decode on Hopper (`flash_mla_with_kvcache(..., use_legacy=True)`) reads a paged
cache of 64-row pages and applies either no mask or a causal one over the last t rows; it cannot apply
a tree mask. Two ways a serving engine verifies a tree with it, both timed against ours:
- `causal`: one call with causal=True (a chain's mask: the time a tree would cost if FlashMLA took one);
- `cascade`: FlashMLA over the prefix only (no mask), our kernel over the t tree rows with the tree
  mask, and the two merged by their log-sum-exps (`merge_by_lse`), as FlashInfer's cascade attention
  does: exact, three launches and a second copy of the tree's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

PAGE = 64  # FlashMLA's page size


def load() -> ModuleType | None:
    """The flash_mla module, or None where it is not installed (or does not load on this torch)."""
    try:
        import flash_mla
    except Exception:  # ImportError, or a missing symbol of an extension built for another torch
        return None
    return flash_mla


def as_pages(kv: torch.Tensor, block_table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Our cache as FlashMLA reads it: ([pages, 64, 1, d], block_table [b, pages] int32). A contiguous
    [b, s_max, d] cache is viewed as b * s_max / 64 pages (no copy; s_max a multiple of 64); a paged one
    must already have 64-row pages (ValueError otherwise)."""
    d = kv.shape[-1]
    if block_table is not None:
        if kv.shape[1] != PAGE:
            raise ValueError(f"kv: FlashMLA reads pages of {PAGE} rows, got pages of {kv.shape[1]}")
        return kv.view(-1, PAGE, 1, d), block_table.to(torch.int32)
    b, s_max, _ = kv.shape
    if s_max % PAGE:
        raise ValueError(f"kv: FlashMLA reads pages of {PAGE} rows; s_max = {s_max} is not a multiple")
    per = s_max // PAGE
    table = torch.arange(b * per, dtype=torch.int32, device=kv.device).view(b, per)
    return kv.view(b * per, PAGE, 1, d), table


def merge_by_lse(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint key sets (out [b, t, h, d_v], lse [b, t, h],
    natural log) -> the attention over their union: each output weighted by exp(its lse - the union's)."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    w_a = torch.exp(lse_a.float() - lse)[..., None]
    w_b = torch.exp(lse_b.float() - lse)[..., None]
    return (w_a * out_a.float() + w_b * out_b.float()).to(out_a.dtype), lse


@dataclass
class FlashMLACall:
    """One dense decode call on fixed inputs: FlashMLA fills its schedule on the first call (made when
    this is built, outside any graph capture) and reuses it for every later call of the same shapes."""

    module: ModuleType
    q: torch.Tensor  # [b, t, h, d]
    pages: torch.Tensor  # [pages, 64, 1, d]
    block_table: torch.Tensor  # [b, pages per request] int32
    seqlens: torch.Tensor  # [b] int32
    scale: float
    d_v: int
    causal: bool

    def __post_init__(self) -> None:
        self.meta = self.module.get_mla_metadata()[0]
        self()

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [b, t, h, d_v], lse [b, t, h] float32): FlashMLA's lse [b, h, t] transposed to ours."""
        out, lse = self.module.flash_mla_with_kvcache(
            self.q, self.pages, self.block_table, self.seqlens, self.d_v, self.meta,
            softmax_scale=self.scale, causal=self.causal, use_legacy=True,
        )  # fmt: skip
        return out, lse.transpose(1, 2)


def causal_call(module, q, kv, lengths, block_table, scale: float, d_v: int) -> FlashMLACall:
    """FlashMLA with a causal mask over the last t rows of each request (lengths: prefix + t)."""
    pages, table = as_pages(kv, block_table)
    return FlashMLACall(module, q, pages, table, lengths.to(torch.int32), scale, d_v, causal=True)


@dataclass
class Cascade:
    """FlashMLA over the prefix, our attention over the tree rows with the tree mask, merged by lse.
    `tree_kv` [b, t, d] holds each request's tree rows (a serving engine keeps them apart or gathers
    them); built once, outside any capture."""

    prefix: FlashMLACall
    tree_plan: object  # attention.AttentionPlan over tree_kv
    q: torch.Tensor
    tree_kv: torch.Tensor

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out_p, lse_p = self.prefix()
        out_t, lse_t = self.tree_plan.run(self.q, self.tree_kv)
        return merge_by_lse(out_p, lse_p, out_t, lse_t)


def cascade_call(
    module, q, kv, lengths, block_table, visibility, scale: float, d_v: int, impl=None
) -> Cascade:
    """The cascade of the module docstring on one problem: every request's prefix is lengths - t rows
    (at least one), its tree the last t rows of its cache."""
    from kdtree_engine.attention import plan_attention
    from kdtree_engine.ref.mla_attention import gather_kv

    b, t = q.shape[:2]
    pages, table = as_pages(kv, block_table)
    flat = kv if block_table is not None else kv.view(-1, PAGE, kv.shape[-1])
    rows = [gather_kv(flat, table, r, int(lengths[r]))[-t:] for r in range(b)]
    tree_kv = torch.stack(rows).contiguous()  # [b, t, d]
    tree_lengths = torch.full((b,), t, dtype=lengths.dtype, device=lengths.device)
    plan = plan_attention(q, tree_kv, tree_lengths, softmax_scale=scale, d_v=d_v, visibility=visibility,
                          impl=impl)  # fmt: skip
    prefix = FlashMLACall(module, q, pages, table, (lengths - t).to(torch.int32), scale, d_v, causal=False)
    return Cascade(prefix, plan, q, tree_kv)
