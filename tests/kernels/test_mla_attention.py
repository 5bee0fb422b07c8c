"""Triton tree-verify MLA attention against the float32 reference, on fresh random inputs.

CPU CI runs the kernel through the Triton interpreter at small shapes (d = 32 + 8, few heads, short
caches); the full sweep (d = 512 + 64, h up to 64, t up to 65, prefixes up to 1000) is marked gpu.
Every cache slot the kernel must not read (beyond cache_seqlens, unused pages) holds NaN.
Tolerances: float32 inputs 1e-4 (abs and rel); bf16 inputs 2e-2 on out (bf16 output rounding and bf16
probabilities in P @ V) and 2e-3 on lse (fp32 accumulation of exact bf16 products).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kdtree_engine.attention import plan_attention, tree_mla_attention
from kdtree_engine.kernels import mla_attention_triton as kernels
from kdtree_engine.ref import mla_attention as ref
from kdtree_engine.ref.sglang_attention import visibility_to_bits

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-3), torch.float16: (2e-2, 2e-3)}  # (out, lse)


def make_tree(kind: str, t: int, gen: torch.Generator) -> torch.Tensor:
    """Visibility [t, t] bool of a tree whose nodes are numbered parents-first (node 0 is the root)."""
    vis = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        parent = {"chain": i - 1, "star": 0}.get(kind)
        if parent is None:
            parent = int(torch.randint(0, i, (1,), generator=gen))
        vis[i] |= vis[parent]
    return vis


def make_inputs(b, t, h, d_c, d_r, prefixes, dtype, page, tree, gen, capacity=None):
    """Random q, NaN-poisoned cache (contiguous if page is None, else paged with a shuffled block
    table), lengths, visibility [b, t, t] and ancestor bits (t <= 64)."""
    d = d_c + d_r
    lengths = torch.tensor([p + t for p in prefixes])
    s_max = capacity or int(lengths.max())
    q = torch.randn(b, t, h, d, generator=gen).to(dtype)
    vis = torch.stack([make_tree(tree, t, gen) for _ in range(b)])
    bits = None
    if t <= 64:
        weights = torch.tensor([1 << j for j in range(63)] + [-(1 << 63)])[:t]
        bits = (vis.long() * weights).sum(-1)
    contiguous = torch.full((b, s_max, d), float("nan"))
    for r, n in enumerate(lengths.tolist()):
        contiguous[r, :n] = torch.randn(n, d, generator=gen)
    if page is None:
        return q, contiguous.to(dtype), lengths, vis, bits, None
    max_pages = -(-s_max // page)
    pages = b * max_pages + 3  # spare pages stay NaN
    order = torch.randperm(pages, generator=gen)
    block_table = order[: b * max_pages].view(b, max_pages).int()
    paged = torch.full((pages, page, d), float("nan"))
    for r, n in enumerate(lengths.tolist()):
        for p in range(-(-n // page)):
            rows = min(page, n - p * page)
            paged[block_table[r, p], :rows] = contiguous[r, p * page : p * page + rows]
        block_table[r, -(-n // page) :] = order[-1]  # unused entries point at a NaN page
    return q, paged.to(dtype), lengths, vis, bits, block_table


def assert_close(name, got, want, tol):
    """|got - want| <= tol * (1 + |want|) everywhere; on failure report the worst element."""
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any(), f"{name}: NaN at {got.isnan().nonzero()[0].tolist()}"
    excess = (got - want).abs() - tol * (1 + want.abs())
    worst = int(excess.argmax())
    idx = list(torch.unravel_index(torch.tensor(worst), got.shape))
    idx = [int(i) for i in idx]
    assert excess.max() <= 0, (
        f"{name}: worst at {idx}: got {got.flatten()[worst]:.6g}, want {want.flatten()[worst]:.6g} "
        f"(tol {tol}, rel-norm {((got - want).norm() / want.norm()):.3g})"
    )


def check(device, b, t, h, d_c, d_r, prefixes, dtype, page, tree, seed, mask="visibility", impl="triton",
          num_splits=None, config=None, force_hopper=False):  # fmt: skip
    """Kernel vs reference through the public plan; mask: how the kernel gets the tree ("visibility",
    "bits": ancestor bits, "causal": neither, for chain trees). config: a Triton launch shape;
    force_hopper: the Hopper kernel even where the dispatch would not pick it (few rows)."""
    gen = torch.Generator().manual_seed(seed)
    q, kv, lengths, vis, bits, bt = make_inputs(b, t, h, d_c, d_r, prefixes, dtype, page, tree, gen)
    scale = (d_c + d_r) ** -0.5 * 1.3
    want_out, want_lse = ref.tree_mla_attention(q, kv, lengths, vis, scale, d_c, bt)
    q, kv, lengths, vis, bits, bt = (
        x.to(device) if x is not None else None for x in (q, kv, lengths, vis, bits, bt)
    )
    masks = {"visibility": {"visibility": vis}, "bits": {"ancestor_bits": bits}, "causal": {}}
    assert mask != "causal" or tree == "chain"
    plan = plan_attention(q, kv, lengths, softmax_scale=scale, d_v=d_c, block_table=bt, impl=impl,
                          num_splits=num_splits, **masks[mask])  # fmt: skip
    if config is not None:
        launch = kernels.plan(plan.problem, dtype, q.device, int(lengths.max()), 4, config, num_splits)
        plan = dataclasses.replace(plan, launch=launch)
    if force_hopper:
        from kdtree_engine.kernels import mla_attention_hopper as hopper

        launch = hopper.plan(plan.problem, q.device, int(lengths.max()), num_splits or 0)
        plan = dataclasses.replace(plan, kernel="hopper", launch=launch)
    got_out, got_lse = plan.run(q, kv)
    assert got_out.dtype == dtype and got_out.shape == (b, t, h, d_c)
    assert got_lse.dtype == torch.float32 and got_lse.shape == (b, t, h)
    tol_out, tol_lse = TOL[dtype]
    assert_close("out", got_out, want_out, tol_out)
    assert_close("lse", got_lse, want_lse, tol_lse)
    return plan


SMALL = [  # (t, h, prefixes, page, tree, splits)
    (1, 1, [0, 1, 64], None, "chain", None),
    (2, 2, [63, 0, 65], 1, "chain", None),
    (9, 1, [64, 3], 64, "random", 3),
    (9, 2, [0, 130], None, "star", 2),
    (17, 1, [65, 1], 16, "random", None),
    (17, 2, [100], None, "random", 4),
    (33, 1, [0, 63], 64, "star", 2),
    (65, 1, [1, 64], None, "random", None),
    (2, 8, [0, 1, 63, 64, 65], 64, "random", None),
    (9, 16, [1, 63], 1, "chain", 2),
    (5, 4, [200, 0, 129], None, "random", 5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"t{c[0]}-h{c[1]}-p{c[3]}-{c[4]}-s{c[5]}")
def test_small_dims_match_reference(device, case, dtype):
    t, h, prefixes, page, tree, splits = case
    check(
        device,
        len(prefixes),
        t,
        h,
        32,
        8,
        prefixes,
        dtype,
        page,
        tree,
        seed=t * 1000 + h * 100 + sum(prefixes),
        num_splits=splits,
    )


@pytest.mark.parametrize("d_c,d_r", [(64, 16), (32, 0)])
def test_other_head_dims(device, d_c, d_r):
    check(device, 2, 5, 3, d_c, d_r, [7, 70], torch.float32, None, "random", seed=d_c + d_r)


def test_fixed_configs(device):
    cfg = kernels.Config(block_m=16, block_n=16, num_warps=4, num_stages=1)
    check(device, 2, 9, 2, 32, 8, [40, 17], torch.bfloat16, 16, "random", seed=5, config=cfg, num_splits=3)
    cfg = kernels.Config(block_m=64, block_n=32, num_warps=8, num_stages=3)
    check(device, 3, 3, 8, 32, 8, [0, 33, 70], torch.float32, None, "chain", seed=6, config=cfg)


@pytest.mark.parametrize("mask", ["bits", "causal"])
def test_public_op_mask_forms(device, mask):
    gen = torch.Generator().manual_seed(7)
    b, t, h = 2, 9, 2
    q, kv, lengths, vis, bits, bt = make_inputs(b, t, h, 32, 8, [20, 66], torch.float32, 64, "random", gen)
    q, kv, lengths, vis, bits, bt = (x.to(device) for x in (q, kv, lengths, vis, bits, bt))
    kwargs = {"ancestor_bits": bits} if mask == "bits" else {}
    want_vis = (
        vis if mask == "bits" else torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
    )
    got = tree_mla_attention(
        q, kv, lengths, softmax_scale=0.2, d_v=32, block_table=bt, impl="triton", **kwargs
    )
    want = ref.tree_mla_attention(q, kv, lengths, want_vis, 0.2, 32, bt)
    assert_close("out", got[0], want[0], 1e-4)
    assert_close("lse", got[1], want[1], 1e-4)
    via_ref = tree_mla_attention(
        q, kv, lengths, softmax_scale=0.2, d_v=32, block_table=bt, impl="ref", **kwargs
    )
    assert_close("ref out", via_ref[0], want[0], 1e-6)


@pytest.mark.parametrize("splits", [1, 3])
def test_causal_prefill_skips_future_tiles(device, splits):
    """Causal with many row blocks (t = 70 > 64, so no ancestor bits): each block stops at its last node."""
    cfg = kernels.Config(block_m=16, block_n=16, num_warps=4, num_stages=1)
    check(device, 2, 70, 1, 32, 8, [0, 45], torch.float32, None, "chain", seed=11 + splits, mask="causal",
          num_splits=splits, config=cfg)  # fmt: skip


def test_plan_runs_every_layer_and_checks_its_shapes(device):
    """One plan, several layers' caches: each run equals its own one-shot call; a layer of another shape
    or dtype is refused (the plan's launch would not fit it)."""
    gen = torch.Generator().manual_seed(21)
    q, kv, lengths, vis, _, _ = make_inputs(2, 5, 2, 32, 8, [9, 40], torch.float32, None, "random", gen)
    q, kv, lengths, vis = (x.to(device) for x in (q, kv, lengths, vis))
    kw = dict(softmax_scale=0.2, d_v=32, visibility=vis, impl="triton")
    layers = [kv, kv.nan_to_num(0.0) * 0.5]
    plan = plan_attention(q, kv, lengths, **kw)
    for layer in layers:
        assert torch.equal(plan.run(q, layer)[0], tree_mla_attention(q, layer, lengths, **kw)[0])
    with pytest.raises(ValueError, match="^q:"):
        plan.run(q[:, :4], kv)
    with pytest.raises(ValueError, match="^kv_cache:"):
        plan.run(q, kv.to(torch.bfloat16))


def _valid(device):
    gen = torch.Generator().manual_seed(3)
    q, kv, lengths, vis, bits, _ = make_inputs(2, 4, 2, 32, 8, [5, 6], torch.float32, None, "random", gen)
    return {"q": q, "kv_cache": kv, "cache_seqlens": lengths, "visibility": vis}


BAD = {
    "q": lambda a: {"q": a["q"].to(torch.int32)},
    "d_v": lambda a: {"d_v": 41},
    "kv_cache": lambda a: {"kv_cache": a["kv_cache"][..., :39]},
    "cache_seqlens": lambda a: {"cache_seqlens": a["cache_seqlens"] - 6},
    "visibility": lambda a: {"visibility": a["visibility"] & ~torch.eye(4, dtype=torch.bool)},
    "ancestor_bits": lambda a: {"ancestor_bits": torch.ones(2, 4, dtype=torch.long)},
    "softmax_scale": lambda a: {"softmax_scale": float("nan")},
    "block_table": lambda a: {"block_table": torch.zeros(3, 2, dtype=torch.int32)},
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name):
    args = _valid("cpu")
    kwargs = {"softmax_scale": 0.1, "d_v": 32, **{k: v for k, v in args.items() if k != "q"}}
    kwargs.update(BAD[name](args))
    if name == "ancestor_bits":
        kwargs.pop("visibility")  # bits == 1 everywhere: row 1 lacks its own bit 1
    q = kwargs.pop("q", args["q"])
    with pytest.raises(ValueError, match=f"^{name}:"):
        tree_mla_attention(q, kwargs.pop("kv_cache"), kwargs.pop("cache_seqlens"), impl="ref", **kwargs)


@pytest.mark.parametrize("form", ["visibility", "ancestor_bits"])
def test_a_row_that_sees_a_later_node_is_refused(form):
    """The kernels stop a row block's tiles at its last node's slot, so a tree must list every ancestor
    before its node: node 0 seeing node 3 is refused, naming the argument (the diagonal is intact)."""
    args = _valid("cpu")
    vis = args.pop("visibility").clone()
    vis[1, 0, 3] = True
    tree = {"visibility": vis} if form == "visibility" else {"ancestor_bits": visibility_to_bits(vis)}
    with pytest.raises(ValueError, match=f"^{form}: row i sees a later node"):
        tree_mla_attention(args["q"], args["kv_cache"], args["cache_seqlens"], softmax_scale=0.1, d_v=32,
                           impl="ref", **tree)  # fmt: skip


def test_too_long_and_both_masks_raise():
    args = _valid("cpu")
    with pytest.raises(ValueError, match="cache_seqlens"):
        tree_mla_attention(args["q"], args["kv_cache"], args["cache_seqlens"] + 5, softmax_scale=0.1, d_v=32)
    with pytest.raises(ValueError, match="ancestor_bits"):
        tree_mla_attention(
            args["q"],
            args["kv_cache"],
            args["cache_seqlens"],
            softmax_scale=0.1,
            d_v=32,
            visibility=args["visibility"],
            ancestor_bits=torch.full((2, 4), -1),
        )


# Full sweep on the GPU: Kimi dims, every cache length of the issue in one ragged batch.
PREFIXES = [0, 1, 63, 64, 65, 1000]


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 1, 64])
@pytest.mark.parametrize("tree", ["chain", "star", "random"])
@pytest.mark.parametrize("h", [1, 8, 16, 64])
@pytest.mark.parametrize("t", [1, 2, 9, 17, 33, 65])
def test_gpu_full_sweep(device, t, h, tree, page):
    check(device, len(PREFIXES), t, h, 512, 64, PREFIXES, torch.bfloat16, page, tree, seed=t * 100 + h)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t,h,dtype", [(512, 8, torch.bfloat16), (600, 2, torch.bfloat16), (9, 16, torch.float32)]
)
def test_gpu_long_prefill_and_float32(device, t, h, dtype):
    check(device, 2, t, h, 512, 64, [0, 300], dtype, None, "chain", seed=t)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 32])
def test_gpu_split_counts(device, splits):
    check(
        device,
        3,
        9,
        64,
        512,
        64,
        [4000, 17, 2500],
        torch.bfloat16,
        64,
        "random",
        seed=splits,
        num_splits=splits,
    )


def _hopper(device) -> bool:
    from kdtree_engine.kernels import mla_attention_hopper as hopper

    return hopper.supported_device(torch.device(device).index or 0)


# Each implementation pinned: "hopper" (TMA boxes on contiguous caches and pages of 64, rows gathered by
# cp.async on pages of 1 and 16) and "triton", every page size, several forced split counts, fp16 on some.
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["hopper", "triton"])
@pytest.mark.parametrize("page", [None, 1, 16, 64])
@pytest.mark.parametrize("splits", [None, 1, 3, 5])
def test_gpu_impls(device, impl, page, splits):
    if impl == "hopper" and not _hopper(device):
        pytest.skip("the Hopper kernel needs a compute capability 9.x GPU")
    dtype = torch.float16 if page == 16 or (page == 64 and splits == 3) else torch.bfloat16
    plan = check(device, 5, 17, 16, 512, 64, [0, 63, 64, 129, 3000], dtype, page, "random", seed=7, impl=impl,
                 num_splits=splits)  # fmt: skip
    assert plan.kernel == impl


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 16, 64])
def test_gpu_few_rows_on_gathered_pages_stay_with_triton(device, page):
    """Decode (t * h <= 16) on pages the Hopper kernel must gather row by row runs the Triton kernel
    (not yet timed against it); on pages of 64 the Hopper kernel takes it."""
    if not _hopper(device):
        pytest.skip("the Hopper kernel needs a compute capability 9.x GPU")
    plan = check(device, 3, 1, 8, 512, 64, [5, 700, 64], torch.bfloat16, page, "chain", seed=page,
                 impl="hopper")  # fmt: skip
    assert plan.kernel == ("hopper" if page == 64 else "triton")


# The Hopper kernel's mask modes and its schedule cutting row blocks at every place (splits: each row
# block cut into that many runs, so programs start and end mid-block and span block edges), also at
# shapes the dispatch gives to the Triton kernel (16 query rows or fewer).
@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["visibility", "bits", "causal"])
@pytest.mark.parametrize("splits", [None, 2, 7])
@pytest.mark.parametrize("t,h,page", [(9, 64, None), (33, 8, 64), (64, 2, None), (5, 16, None), (1, 8, None),
                                      (3, 1, 64), (70, 1, None), (33, 8, 1), (9, 64, 1), (1, 8, 1),
                                      (3, 1, 16), (17, 8, 48)])  # fmt: skip
def test_gpu_hopper_schedule(device, mask, splits, t, h, page):
    if not _hopper(device):
        pytest.skip("the Hopper kernel needs a compute capability 9.x GPU")
    if mask == "bits" and t > 64:
        pytest.skip("ancestor bits hold trees of at most 64 nodes")
    tree = "chain" if mask == "causal" else "random"
    check(device, 4, t, h, 512, 64, [0, 127, 128, 700], torch.bfloat16, page, tree, seed=t + h, mask=mask,
          num_splits=splits, force_hopper=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("impl,h,page", [("hopper", 64, None), ("hopper", 8, None), ("triton", 8, None),
                                         ("hopper", 8, 1), ("hopper", 64, 1)])  # fmt: skip
def test_gpu_captured_plan_replays_new_lengths(device, impl, h, page):
    """A plan built and run inside a CUDA graph (no host read: the schedule is computed on the device)
    replays correctly after the lengths change in place, longer and shorter than at capture; page 1:
    the same cache as SGLang's token pool, its rows gathered through a block table in reverse order."""
    if impl == "hopper" and not _hopper(device):
        pytest.skip("the Hopper kernel needs a compute capability 9.x GPU")
    gen = torch.Generator().manual_seed(h)
    b, t, d_c = 3, 9, 512
    q, kv, lengths, vis, _, _ = make_inputs(b, t, h, d_c, 64, [100, 2000, 0], torch.bfloat16, None, "random",
                                            gen, capacity=6000)  # fmt: skip
    kv = torch.randn(kv.shape, generator=gen).to(torch.bfloat16)  # every slot valid: lengths may grow
    q, kv, vis = q.cuda(), kv.cuda(), vis.cuda()
    seqlens = lengths.cuda()
    table = None
    if page == 1:  # request r's position p at row (b - 1 - r) * cap + p of a [b * cap, 1, d] pool
        cap = kv.shape[1]
        table = (torch.arange(b - 1, -1, -1)[:, None] * cap + torch.arange(cap)).int().cuda()
        kv = kv.flip(0).reshape(b * cap, 1, kv.shape[-1]).contiguous()
    kw = dict(softmax_scale=0.05, d_v=d_c, visibility=vis, impl=impl, block_table=table)
    plan_attention(q, kv, seqlens, **kw).run(q, kv)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan_attention(q, kv, seqlens, **kw).run(q, kv)
    for new in ([100, 2000, 9], [5000, 40, 3999], [9, 9, 9]):
        seqlens.copy_(torch.tensor(new))
        graph.replay()
        want_out, want_lse = ref.tree_mla_attention(
            q.cpu(), kv.cpu(), torch.tensor(new), vis.cpu(), 0.05, d_c, None if table is None else table.cpu()
        )
        assert_close("out", out, want_out, TOL[torch.bfloat16][0])
        assert_close("lse", lse, want_lse, TOL[torch.bfloat16][1])


def test_impl_is_checked_and_dispatch_reads_as_a_table(device):
    """impl is one of the package's names; the table picks the reference on the CPU, the Triton kernel
    where asked or where the Hopper kernel does not serve (float32, d = 32 + 8)."""
    gen = torch.Generator().manual_seed(1)
    q, kv, lengths, vis, _, _ = make_inputs(1, 2, 2, 32, 8, [5], torch.float32, None, "chain", gen)
    q, kv, lengths, vis = (x.to(device) for x in (q, kv, lengths, vis))
    kw = dict(softmax_scale=0.1, d_v=32, visibility=vis)
    with pytest.raises(ValueError, match="^impl:"):
        tree_mla_attention(q, kv, lengths, impl="sm90", **kw)
    assert plan_attention(q, kv, lengths, impl="ref", **kw).kernel == "ref"
    assert plan_attention(q, kv, lengths, impl="triton", **kw).kernel == "triton"
    assert plan_attention(q, kv, lengths, **kw).kernel == ("triton" if q.is_cuda else "ref")
    if not q.is_cuda or not _hopper(device):
        with pytest.raises(ValueError, match="^impl: 'hopper' needs"):
            plan_attention(q, kv, lengths, impl="hopper", **kw)
    else:
        assert plan_attention(q, kv, lengths, impl="hopper", **kw).kernel == "triton"


def test_float64_runs_the_reference_and_refuses_the_kernel(device):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 3, 2, 40, generator=g, dtype=torch.float64)
    kv = torch.randn(1, 8, 40, generator=g, dtype=torch.float64)
    lengths = torch.tensor([8])
    on = (q.to(device), kv.to(device), lengths.to(device))
    out, lse = tree_mla_attention(*on, softmax_scale=0.2, d_v=32)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    out = out.cpu()
    # Causal over the last 3 slots, written out in float64 by hand.
    scores = torch.einsum("thd,sd->ths", q[0], kv[0]) * 0.2
    allowed = torch.ones(3, 8, dtype=torch.bool)
    allowed[:, 5:] = torch.ones(3, 3, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    expect = torch.einsum("ths,sd->thd", torch.softmax(scores, -1), kv[0, :, :32])
    assert torch.allclose(out[0], expect, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="^q:"):
        tree_mla_attention(*on, softmax_scale=0.2, d_v=32, impl="triton")


def test_split_count_fills_the_chip_at_batch_one():
    """Decode at b = 1 (t*h <= 16: the Triton kernel) on 132 multiprocessors: a long cache is cut into
    MAX_SPLITS = 128 splits (measured best at s = 32k and 128k since the merge reads splits in rounds);
    larger batches keep fewer splits, one wave of programs; a short cache gets no more splits than tiles."""
    cfg = kernels.pick_config(torch.bfloat16, 8, 512)
    assert kernels.pick_num_splits(1, 1, 32768, cfg, 512, 576, 132) == kernels.MAX_SPLITS == 128
    assert kernels.pick_num_splits(2, 1, 32768, cfg, 512, 576, 132) == 64
    assert kernels.pick_num_splits(16, 1, 4096, cfg, 512, 576, 132) == 8
    assert kernels.pick_num_splits(1, 1, 300, cfg, 512, 576, 132) <= 5  # 5 tiles of 64 slots


def test_decode_launch_follows_the_cache_length():
    """A contiguous decode (t*h <= 16) of up to SHORT_BATCH requests on caches up to SHORT_CACHE takes
    32-slot tiles; longer or unknown lengths and larger batches 64-slot ones; a paged decode keeps its
    32-slot, 5-stage launch; more rows keep the 64-row launch whatever the length."""
    bf16 = torch.bfloat16
    for batch in (1, kernels.SHORT_BATCH):
        short = kernels.pick_config(bf16, 16, 512, max_len=kernels.SHORT_CACHE, batch=batch)
        assert (short.block_m, short.block_n, short.num_stages) == (16, 32, 3)
    for long in (None, kernels.SHORT_CACHE + 1, 32768):
        assert kernels.pick_config(bf16, 16, 512, max_len=long, batch=1).block_n == 64
    assert kernels.pick_config(bf16, 16, 512, max_len=100, batch=kernels.SHORT_BATCH + 1).block_n == 64
    assert kernels.pick_config(bf16, 8, 512, paged=True, max_len=100, batch=1) == kernels.Config(16, 32, 4, 5)
    assert kernels.pick_config(bf16, 17, 512, max_len=100, batch=1).block_m == 64


def test_a_length_hint_steers_the_split_count_and_is_not_trusted(device):
    """length_hint (a captured forward's expected longest length, without max_seqlen) steers the Triton
    kernel's split count as max_seqlen would: a cache of 1024 slots whose rows in use are few is
    planned as the few rows; lengths past the hint still get the exact attention (each request's
    chunks are sized from its own length on the device)."""
    gen = torch.Generator().manual_seed(5)
    t, h, d_c, d_r = 1, 2, 32, 8
    q, kv, lengths, vis, _, _ = make_inputs(3, t, h, d_c, d_r, [40, 700, 3], torch.float32, None, "chain",
                                            gen, capacity=1024)  # fmt: skip
    scale = (d_c + d_r) ** -0.5
    want_out, want_lse = ref.tree_mla_attention(q, kv, lengths, vis, scale, d_c, None)
    q, kv, lengths = q.to(device), kv.to(device), lengths.to(device)
    kwargs = dict(softmax_scale=scale, d_v=d_c, impl="triton", validate=False)
    capacity = plan_attention(q, kv, lengths, **kwargs)
    hinted = plan_attention(q, kv, lengths, length_hint=48, **kwargs)
    known = plan_attention(q, kv, lengths, max_seqlen=48, **kwargs)
    assert hinted.launch.num_splits == known.launch.num_splits < capacity.launch.num_splits
    got_out, got_lse = hinted.run(q, kv)  # request 1 has 701 rows, past the hint
    assert_close("out", got_out, want_out, TOL[torch.float32][0])
    assert_close("lse", got_lse, want_lse, TOL[torch.float32][1])
