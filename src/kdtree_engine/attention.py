"""Public tree-verify MLA attention op (absorbed form, tree mask). See DESIGN.md section 2."""

from __future__ import annotations

import math
import os

import torch

from kdtree_engine.impl import capturing, resolve_impl
from kdtree_engine.ref import mla_attention as ref

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: impl="ref" only
# the sm90-* names are "sm90-" + kernels.mla_attention_sm90.VARIANTS (a test holds them equal)
BACKENDS = ("auto", "triton", "sm90", "sm90-roles", "sm90-pipe", "sm90-sched", "sm90-double", "sm90-wide")
BACKEND_ENV = "KDTREE_ATTENTION_BACKEND"
INT_DTYPES = (torch.int32, torch.int64)


def tree_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    d_v: int = 512,
    visibility: torch.Tensor | None = None,
    ancestor_bits: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    impl: str | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of t tree (or new) tokens per request over its cached prefix plus the tree itself.

    q [b, t, h, d_v + d_r] absorbed queries (bf16, fp16 or float32; float64 runs the reference);
    kv_cache [b, s_max, d_v + d_r] contiguous per request, or [pages, page_size, d_v + d_r] with
    block_table [b, max_pages] int32/int64;
    cache_seqlens [b] int: slots in use, prefix + t (the tree is the last t slots);
    visibility [b, t, t] bool or ancestor_bits [b, t] int64 (t <= 64); neither means causal.
    Row i of the mask must see itself (diagonal set). Returns out [b, t, h, d_v] in q's dtype and
    lse [b, t, h] float32 (float64 for float64 q; natural log). Value checks (lengths, diagonal, pages)
    need one host sync and are skipped while a CUDA graph is being captured.
    backend (kernels only): "auto" (default: the Hopper Gluon kernel for the prefix where it applies,
    see docs/attention.md, else the Triton kernel), "triton" (the Triton kernel alone), "sm90",
    "sm90-roles", "sm90-pipe", "sm90-sched", "sm90-double", "sm90-wide"; None reads the environment
    variable KDTREE_ATTENTION_BACKEND (so a whole model can be switched), else "auto".
    """
    _check_shapes(q, kv_cache, cache_seqlens, softmax_scale, d_v, visibility, ancestor_bits, block_table)
    max_seqlen = _check_values(q, kv_cache, cache_seqlens, visibility, ancestor_bits, block_table)
    b, t = q.shape[:2]
    backend = _check_backend(backend)
    chosen = resolve_impl(impl, q.device)
    if q.dtype == torch.float64:
        _expect(impl != "triton", "q", "float64 runs only with impl='ref' (the kernels take bf16/fp16/fp32)")
        chosen = "ref"
    if chosen == "triton":
        from kdtree_engine.kernels import mla_attention as kernels

        return kernels.tree_mla_attention(
            q,
            kv_cache,
            cache_seqlens,
            visibility,
            softmax_scale,
            d_v,
            block_table,
            ancestor_bits=ancestor_bits,
            causal=visibility is None and ancestor_bits is None,
            max_seqlen=max_seqlen,
            backend=backend,
        )
    if visibility is None:
        if ancestor_bits is not None:
            visibility = ref.bits_to_visibility(ancestor_bits, t)
        else:
            visibility = torch.ones(t, t, dtype=torch.bool, device=q.device).tril().expand(b, t, t)
    out, lse = ref.tree_mla_attention(q, kv_cache, cache_seqlens, visibility, softmax_scale, d_v, block_table)
    return out.to(q.dtype), lse


def _check_backend(backend: str | None) -> str:
    if backend is None:
        env = os.environ.get(BACKEND_ENV)
        if env is None:
            return "auto"
        _expect(env in BACKENDS, BACKEND_ENV, f"expected one of {BACKENDS}, got {env!r}")
        return env
    _expect(backend in BACKENDS, "backend", f"expected one of {BACKENDS} or None, got {backend!r}")
    return backend


def _expect(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


def _check_shapes(q, kv_cache, cache_seqlens, softmax_scale, d_v, visibility, ancestor_bits, block_table):
    _expect(q.dim() == 4 and min(q.shape) > 0, "q", f"expected [b, t, h, d] non-empty, got {tuple(q.shape)}")
    _expect(q.dtype in DTYPES, "q", f"dtype must be one of {DTYPES}, got {q.dtype}")
    b, t, h, d = q.shape
    _expect(0 < d_v <= d, "d_v", f"expected 0 < d_v <= d = {d}, got {d_v}")
    _expect(math.isfinite(softmax_scale) and softmax_scale > 0, "softmax_scale", f"got {softmax_scale}")
    _expect(
        kv_cache.dim() == 3 and kv_cache.shape[2] == d,
        "kv_cache",
        f"expected [*, *, {d}], got {tuple(kv_cache.shape)}",
    )
    _expect(kv_cache.dtype == q.dtype, "kv_cache", f"dtype {kv_cache.dtype} differs from q's {q.dtype}")
    _expect(kv_cache.device == q.device, "kv_cache", f"on {kv_cache.device}, q on {q.device}")
    _expect(
        tuple(cache_seqlens.shape) == (b,) and cache_seqlens.dtype in INT_DTYPES,
        "cache_seqlens",
        f"expected [{b}] int32/int64, got {tuple(cache_seqlens.shape)} {cache_seqlens.dtype}",
    )
    _expect(cache_seqlens.device == q.device, "cache_seqlens", f"on {cache_seqlens.device}, q on {q.device}")
    if block_table is None:
        _expect(
            kv_cache.shape[0] == b,
            "kv_cache",
            f"contiguous cache needs [b={b}, s_max, d], got {tuple(kv_cache.shape)}",
        )
    else:
        _expect(
            block_table.dim() == 2 and block_table.shape[0] == b and block_table.dtype in INT_DTYPES,
            "block_table",
            f"expected [{b}, max_pages] int32/int64, got {tuple(block_table.shape)} {block_table.dtype}",
        )
        _expect(block_table.device == q.device, "block_table", f"on {block_table.device}, q on {q.device}")
    _expect(visibility is None or ancestor_bits is None, "ancestor_bits", "give visibility or ancestor_bits")
    if visibility is not None:
        _expect(
            tuple(visibility.shape) == (b, t, t) and visibility.dtype == torch.bool,
            "visibility",
            f"expected [{b}, {t}, {t}] bool, got {tuple(visibility.shape)} {visibility.dtype}",
        )
        _expect(visibility.device == q.device, "visibility", f"on {visibility.device}, q on {q.device}")
    if ancestor_bits is not None:
        _expect(t <= 64, "ancestor_bits", f"only for t <= 64 (got t = {t}); pass visibility")
        _expect(
            tuple(ancestor_bits.shape) == (b, t) and ancestor_bits.dtype == torch.int64,
            "ancestor_bits",
            f"expected [{b}, {t}] int64, got {tuple(ancestor_bits.shape)} {ancestor_bits.dtype}",
        )
        _expect(
            ancestor_bits.device == q.device, "ancestor_bits", f"on {ancestor_bits.device}, q on {q.device}"
        )


def _check_values(q, kv_cache, cache_seqlens, visibility, ancestor_bits, block_table) -> int | None:
    """Checks that need the tensors' values, in one host transfer; returns max(cache_seqlens)."""
    if capturing(q.device):
        return None
    b, t = q.shape[:2]
    seq = cache_seqlens.long()
    checks = [seq.min(), seq.max()]
    rows = torch.arange(t, device=q.device)
    if visibility is not None:
        checks.append(visibility[:, rows, rows].all().long())
    if ancestor_bits is not None:
        checks.append(((ancestor_bits >> rows) & 1).bool().all().long())
    if block_table is not None:
        page = kv_cache.shape[1]
        used = torch.arange(block_table.shape[1], device=q.device) * page < seq[:, None]  # [b, max_pages]
        in_range = (block_table >= 0) & (block_table < kv_cache.shape[0])
        checks.append((in_range | ~used).all().long())
    values = torch.stack(checks).tolist()
    capacity = kv_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    _expect(
        values[0] >= t and values[1] <= capacity,
        "cache_seqlens",
        f"expected t = {t} <= length <= capacity {capacity}, got {values[0]}..{values[1]}",
    )
    names = ["visibility"] * (visibility is not None) + ["ancestor_bits"] * (ancestor_bits is not None)
    for name, ok in zip(names, values[2:]):
        _expect(bool(ok), name, "every row must see itself (diagonal must be set)")
    if block_table is not None:
        _expect(bool(values[-1]), "block_table", f"a used entry is outside 0..{kv_cache.shape[0] - 1}")
    return values[1]
