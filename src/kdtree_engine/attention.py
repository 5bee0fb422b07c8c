"""Tree-verify MLA attention (absorbed form, tree mask): the public op and its per-forward plan.

`plan_attention` validates a forward's inputs once, picks the kernel from the dispatch table, sizes
its schedule and workspace, and returns an `AttentionPlan` that every layer's `plan.run(q, kv)` reuses.
`tree_mla_attention` is one plan and one run. A plan built without a host read of the lengths (while a
CUDA graph is captured, or validate=False) computes the Hopper kernel's schedule on the device, so a
captured forward replays correctly for new lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kdtree_engine.impl import capturing, check_impl
from kdtree_engine.kernels.mla_attention_args import LaunchBounds, Mask, Problem
from kdtree_engine.ref import mla_attention as ref

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: impl="ref" only
INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class AttentionPlan:
    """One forward's attention: the kernel that runs ("ref", "triton" or "hopper"), the problem every
    layer shares, and the kernel's launch (schedule and workspace). `run` checks only the shapes."""

    kernel: str
    problem: Problem
    dtype: torch.dtype
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    launch: object | None  # mla_attention_triton.Launch or mla_attention_hopper.Launch

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, t, h, d] and kv_cache of this layer (shapes and dtype as planned) -> out [b, t, h, d_v]
        in q's dtype, lse [b, t, h] float32 (float64 for float64 q)."""
        _expect(tuple(q.shape) == self.q_shape and q.dtype == self.dtype, "q",
                f"planned for {self.q_shape} {self.dtype}, got {tuple(q.shape)} {q.dtype}")  # fmt: skip
        got = f"{tuple(kv_cache.shape)} {kv_cache.dtype}"
        _expect(tuple(kv_cache.shape) == self.kv_shape and kv_cache.dtype == self.dtype, "kv_cache",
                f"planned for {self.kv_shape} {self.dtype}, got {got}")  # fmt: skip
        p = self.problem
        if self.kernel == "ref":
            return _run_ref(p, q, kv_cache)
        q = q.contiguous()
        out = torch.empty(p.b, p.t, p.h, p.d_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(p.b, p.t, p.h, dtype=torch.float32, device=q.device)
        _kernel_module(self.kernel).run(self.launch, p, q, kv_cache, out, lse)
        return out, lse


def plan_attention(
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
    max_seqlen: int | None = None,
    validate: bool = True,
    num_splits: int | None = None,
    invariant: bool = False,
    length_hint: int | None = None,
) -> AttentionPlan:
    """The plan of one forward's attention, for every layer whose q and cache have these shapes.

    q [b, t, h, d_v + d_r] absorbed queries (bf16, fp16 or float32; float64 runs the reference);
    kv_cache [b, s_max, d_v + d_r] contiguous per request, or [pages, page_size, d_v + d_r] with
    block_table [b, max_pages] int32/int64; cache_seqlens [b] int: slots in use, prefix + t (the tree is
    the last t); visibility [b, t, t] bool or ancestor_bits [b, t] int64 (t <= 64); neither: causal.
    Row i of the mask must see itself and no later node (j <= i: ancestors first, as every tree builder
    emits them); the kernels stop each row block's tiles at its last node's slot. impl: None, "ref",
    "triton" or "hopper" (kdtree_engine.impl).
    validate: check the values (lengths, diagonal and order, pages) with one host sync; skipped while a CUDA
    graph is captured. max_seqlen: a bound on cache_seqlens when known (validation finds it); it steers
    the split count and lets the plan skip a merge that has nothing to merge. num_splits: force the KV
    range of each row block into that many pieces (tests). invariant: the row-invariant mode of the Triton
    kernel (kernels/mla_attention_triton.py): a row's bits do not depend on the rest of the launch, and a
    tree node's equal those of the same token decoded alone after its ancestors (a kernel impl only;
    issue 32). length_hint: the longest cache_seqlens the caller expects where max_seqlen is unknown (a
    captured forward, whose cache has margins it seldom fills): steers the Triton kernel's split count
    like max_seqlen, but is not trusted as a bound (any length still runs exactly: each request's
    chunks are sized from its own length on the device), so the Hopper kernel ignores it."""
    _check_shapes(q, kv_cache, cache_seqlens, softmax_scale, d_v, visibility, ancestor_bits, block_table)
    check_impl(impl, q.device)
    if validate and not capturing(q.device):
        max_seqlen = _check_values(q, kv_cache, cache_seqlens, visibility, ancestor_bits, block_table)
    _expect(
        not (invariant and num_splits), "num_splits", "the row-invariant mode fixes its splits by position"
    )
    kernel = choose_kernel(impl, q, kv_cache, d_v, block_table is not None)
    if invariant and kernel == "hopper":
        kernel = "triton"
    b, t, h, d = q.shape
    if kernel == "ref" and visibility is None:
        visibility = _ref_visibility(ancestor_bits, b, t, q.device)
        ancestor_bits = None
    mask = Mask.make(visibility, ancestor_bits, cache_seqlens)
    problem = Problem(b, t, h, d, d_v, softmax_scale, cache_seqlens, mask, block_table)
    capacity = kv_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    bound = min(max_seqlen or capacity, capacity)
    steer = min(max_seqlen or length_hint or capacity, capacity)  # the Triton kernel's split count
    launch = None
    if kernel != "ref":
        bounds = LaunchBounds(bound if max_seqlen else None, steer, num_splits or 0, invariant)
        launch = _kernel_module(kernel).plan_launch(problem, q.dtype, q.device, bounds)
    return AttentionPlan(kernel, problem, q.dtype, tuple(q.shape), tuple(kv_cache.shape), launch)


def tree_mla_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, cache_seqlens: torch.Tensor, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of t tree (or new) tokens per request over its cached prefix plus the tree itself, in
    one call: plan_attention(q, kv_cache, cache_seqlens, **options).run(q, kv_cache); the arguments
    are plan_attention's (softmax_scale, d_v, visibility or ancestor_bits, block_table, impl, ...).
    Returns out [b, t, h, d_v] in q's dtype and lse [b, t, h] float32 (float64 for float64 q)."""
    return plan_attention(q, kv_cache, cache_seqlens, **options).run(q, kv_cache)


def choose_kernel(impl: str | None, q: torch.Tensor, kv_cache: torch.Tensor, d_v: int, paged: bool) -> str:
    """The dispatch table (first match):

    | impl               | when                                    | kernel   |
    |--------------------|-----------------------------------------|----------|
    | "ref"              | always                                  | "ref"    |
    | None               | q on the CPU, or float64 q              | "ref"    |
    | "triton"           | always (the CPU: Triton's interpreter)  | "triton" |
    | None or "hopper"   | the Hopper kernel serves the call       | "hopper" |
    | None or "hopper"   | otherwise (any page size, few rows, ...) | "triton" |

    "hopper" on a GPU that is not sm_90 is an error; the Hopper kernel serves bf16/fp16 on sm_90 with
    d = 512 + 64 and a contiguous cache tensor: on pages of a multiple of 64 rows always, else (a
    contiguous cache, or pages it gathers row by row) with more than 16 query rows per request."""
    if impl == "ref" or (impl is None and (not q.is_cuda or q.dtype == torch.float64)):
        return "ref"
    _expect(
        q.dtype != torch.float64, "q", "float64 runs only with impl='ref' (the kernels take bf16/fp16/fp32)"
    )
    if impl == "triton":
        return "triton"
    from kdtree_engine.kernels import mla_attention_hopper as hopper

    on_hopper = q.is_cuda and hopper.supported_device(q.get_device())
    _expect(impl is None or on_hopper, "impl", "'hopper' needs a CUDA GPU of compute capability 9.x")
    return "hopper" if on_hopper and hopper.serves(q, kv_cache, d_v, paged) else "triton"


def _kernel_module(kernel: str):
    """The module of a kernel of the dispatch table: it plans its launch (schedule, workspace) and runs
    it, merge included (imported on first use: Triton is optional)."""
    if kernel == "hopper":
        from kdtree_engine.kernels import mla_attention_hopper as module
    else:
        from kdtree_engine.kernels import mla_attention_triton as module
    return module


def _run_ref(p: Problem, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vis = p.mask.tensor.view(torch.bool)
    out, lse = ref.tree_mla_attention(q, kv_cache, p.seqlens, vis, p.softmax_scale, p.d_v, p.block_table)
    return out.to(q.dtype), lse


def _ref_visibility(ancestor_bits: torch.Tensor | None, b: int, t: int, device) -> torch.Tensor:
    if ancestor_bits is not None:
        return ref.bits_to_visibility(ancestor_bits, t)
    return torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)


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


def _check_values(q, kv_cache, cache_seqlens, visibility, ancestor_bits, block_table) -> int:
    """Checks that need the tensors' values, in one host transfer; returns max(cache_seqlens)."""
    b, t = q.shape[:2]
    seq = cache_seqlens.long()
    checks = [seq.min(), seq.max()]
    rows = torch.arange(t, device=q.device)
    trees = []  # (name, mask [b, t, t]) of the given tree
    if visibility is not None:
        trees.append(("visibility", visibility))
    if ancestor_bits is not None:
        trees.append(("ancestor_bits", ref.bits_to_visibility(ancestor_bits, t)))
    for _, tree in trees:
        checks.append(tree[:, rows, rows].all().long())
        checks.append((~torch.triu(tree, diagonal=1).any()).long())
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
    for k, (name, _) in enumerate(trees):
        _expect(bool(values[2 + 2 * k]), name, "every row must see itself (diagonal must be set)")
        _expect(bool(values[3 + 2 * k]), name, "row i sees a later node j > i (a tree's nodes must come "
                "ancestors first)")  # fmt: skip
    if block_table is not None:
        _expect(bool(values[-1]), "block_table", f"a used entry is outside 0..{kv_cache.shape[0] - 1}")
    return values[1]
