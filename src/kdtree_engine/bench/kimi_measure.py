"""The measuring sections of `kdtree-engine bench kimi` (bench/kimi.py says what each times). Every
section takes `run`: args, shard (bench/kimi_layer.Shard), device, copy_bw (bytes per second, read +
written) and emit(section, row), which records a row as soon as it is measured."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

from kdtree_engine.bench import kimi_routing as routing
from kdtree_engine.bench.forward_cost import ROUND_ROWS
from kdtree_engine.bench.kimi_layer import (
    AttentionShard,
    MoEShard,
    attention_bytes,
    drafter_shard,
    lm_head_bytes,
    lm_head_shard,
    moe_bytes,
    randomize_,
)
from kdtree_engine.bench.timing import time_graph, time_host
from kdtree_engine.model.linear import linear

BF16 = torch.bfloat16


def _timed(fn, run) -> float:
    return time_graph(fn, rep_ms=run.args.rep_ms).median_us


def _roofline(row: dict, nbytes: int, run) -> dict:
    roof = nbytes / run.copy_bw * 1e6
    return {**row, "bytes": nbytes, "roofline_us": roof, "over_roofline": row["us"] / roof}


def _finite(out: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError(f"{what}: the output is not finite")


def layer(run) -> None:
    """The attention share and its plan per (prefix, batch, tokens); the MoE share per (routing,
    batch, tokens); the lm_head rows per (batch, tokens)."""
    attention(run)
    moe(run)
    lm_head(run)


def attention(run) -> None:
    args, c = run.args, run.shard.attention_config
    with run.device:
        part = randomize_(AttentionShard(c).to(BF16), args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    for prefix in args.prefixes:
        for b in args.batch:
            kv = torch.randn(b, prefix + max(args.tokens), c.latent_dim, device=run.device, dtype=BF16)
            for n in args.tokens:
                _attention_point(run, part, kv, prefix, b, n, gen)
            del kv
            torch.cuda.empty_cache()


def _attention_point(run, part: AttentionShard, kv: torch.Tensor, prefix: int, b: int, n: int, gen) -> None:
    """The attention share and the forward's attention plan at one point (two rows)."""
    from kdtree_engine.attention import plan_attention
    from kdtree_engine.bench.attention import _tree_visibility

    c = part.c
    ctx = part.context(b, n, prefix, _tree_visibility(b, n, gen), impl=None, invariant=run.args.row_invariant)
    x = torch.randn(b, n, c.hidden_size, device=run.device, dtype=BF16)
    _finite(part(x, kv, ctx), "attention share")
    row = {"prefix": prefix, "batch": b, "tokens": n, "kernel": ctx.plan.kernel}
    row["us"] = _timed(lambda: part(x, kv, ctx), run)
    run.emit("attention", _roofline(row, attention_bytes(part, b, n, prefix), run))
    q = torch.randn(b, n, c.num_attention_heads, c.latent_dim, device=run.device, dtype=BF16)
    lengths = ctx.start + n

    def plan():
        return plan_attention(
            q,
            kv,
            lengths,
            softmax_scale=c.softmax_scale,
            d_v=c.kv_lora_rank,
            visibility=ctx.visibility,
            validate=False,
        )

    run.emit("plan", {"prefix": prefix, "batch": b, "tokens": n, "us": _timed(plan, run)})


def moe(run) -> None:
    args, shard = run.args, run.shard
    with run.device:  # built on the GPU: 48 experts are 8.5 GB in float32
        part = randomize_(MoEShard(shard, rank=0).to(BF16), args.seed)
    gen = torch.Generator(device=run.device).manual_seed(args.seed)
    for kind in args.routings:
        for b in args.batch:
            for n in args.tokens:
                _moe_point(run, part, kind, b, n, gen)


def _moe_point(run, part: MoEShard, kind: str, b: int, n: int, gen) -> None:
    """The MoE share at one point, timed on the busiest rank for the routing drawn."""
    grid = run.shard.experts
    ids = routing.route(grid, b, n, kind, seed=run.args.seed + 1000 * b + n)
    part.rank = routing.busiest_rank(ids, grid)
    experts, assignments = routing.rank_load(ids, grid, part.rank)
    x = torch.randn(b, n, part.c.hidden_size, device=run.device, dtype=BF16, generator=gen)
    weights = torch.rand(b * n, grid.top_k, device=run.device, generator=gen)
    ids_dev = ids.to(run.device)
    invariant = run.args.row_invariant
    _finite(part(x, weights, ids_dev, None, invariant), "MoE share")
    row = {
        "routing": kind,
        "batch": b,
        "tokens": n,
        "rank": part.rank,
        "experts_rank": experts,
        "assignments": assignments,
        "experts_request": routing.distinct_per_request(ids, b),
    }
    row["us"] = _timed(lambda: part(x, weights, ids_dev, None, invariant), run)
    run.emit("moe", _roofline(row, moe_bytes(part, b * n, experts), run))


def lm_head(run) -> None:
    args = run.args
    with run.device:
        head = randomize_(lm_head_shard(run.shard).to(BF16), args.seed)
    for b in args.batch:
        for n in args.tokens:
            x = torch.randn(b * n, head.in_features, device=run.device, dtype=BF16)
            gemm = "invariant" if run.args.row_invariant else "torch"  # cuBLAS, as SGLang runs it
            project = partial(linear, x, head.weight, None, gemm)
            row = {"batch": b, "tokens": n, "us": _timed(project, run)}
            run.emit("lm_head", _roofline(row, lm_head_bytes(head, b * n), run))


def _drafter_on_device(run, layers: int):
    """(drafter share with `layers` layers, stand-in target), random bf16 weights on the GPU."""
    with run.device:
        drafter, target = drafter_shard(run.shard, layers)
        drafter = randomize_(drafter.to(BF16), run.args.seed)
        target = SimpleNamespace(
            embed_tokens=randomize_(target.embed_tokens.to(BF16), 1),
            lm_head=randomize_(target.lm_head.to(BF16), 2),
        )
    return drafter, target


def _draft_round(run, model, b: int, prefix: int):
    """A drafting round on a context of `prefix` rows per request: ROUND_ROWS new context rows, then the
    block; the cache length is put back first."""
    drafter, target = model
    block, width = drafter.block_size, drafter.fc.in_features
    cache = drafter.new_cache(b, prefix + 2 * block)
    cache.k.normal_()
    cache.v.normal_()
    cache.seqlens.fill_(prefix)
    saved = cache.seqlens.clone()
    context = torch.randn(b, block, width, device=run.device, dtype=BF16)
    context_lens = torch.full((b,), ROUND_ROWS, device=run.device)
    bonus = torch.randint(0, run.shard.vocab - 1, (b,), device=run.device)
    start = saved + context_lens

    def draft_round():
        cache.seqlens.copy_(saved)
        return drafter.draft(target, context, context_lens, bonus, start, cache)

    _finite(draft_round(), "drafter share")
    return draft_round


def _drafter_attention_calls(run, b: int, prefix: int):
    """(splits chosen, the call with them, the call with one split): one layer's block attention over
    `prefix` context rows per request at the drafter share's heads, on the same random inputs."""
    from kdtree_engine.kernels._device import device_multiprocessors
    from kdtree_engine.kernels.drafter_attention import drafter_attention, pick_splits

    d, tp = run.shard.drafter, run.shard.tp
    h, g, hd, block, slots = d.heads // tp, d.kv_heads // tp, d.head_dim, d.block, prefix + 2 * d.block
    gen = torch.Generator(device=run.device).manual_seed(run.args.seed)
    rnd = partial(torch.randn, device=run.device, dtype=BF16, generator=gen)
    q, k_blk, v_blk = rnd(b, block, h, hd), rnd(b, block, g, hd), rnd(b, block, g, hd)
    cache_k, cache_v = rnd(b, slots, g, hd), rnd(b, slots, g, hd)
    lens = torch.full((b,), prefix, device=run.device, dtype=torch.int64)
    splits = pick_splits(b, g, slots, hd, 2, device_multiprocessors(run.device))
    args = (q, cache_k, cache_v, lens, k_blk, v_blk)
    return splits, partial(drafter_attention, *args), partial(drafter_attention, *args, num_splits=1)


def drafter_attention_split(run, points) -> None:
    """The drafter's attention alone per (prefix, batch): the context in the splits `pick_splits` chooses
    against one program per request and KV head (the launch before splits), same inputs."""
    for prefix, b in points:
        splits, chosen, single = _drafter_attention_calls(run, b, prefix)
        d = run.shard.drafter
        nbytes = b * prefix * (d.kv_heads // run.shard.tp) * d.head_dim * 2 * 2  # K and V read once
        diff = (chosen().float() - single().float()).abs().max().item()
        row = {"prefix": prefix, "batch": b, "splits": splits, "us": _timed(chosen, run),
               "one_split_us": _timed(single, run), "max_diff": diff}  # fmt: skip
        run.emit("drafter_attention", _roofline(row, nbytes, run))


def drafter(run) -> None:
    """Per (prefix, batch): a round with 1 and with 2 drafter layers; per layer = the difference; then
    the drafter's attention alone, split and not."""
    points = [(prefix, b) for prefix in run.args.prefixes for b in run.args.batch]
    times = {}
    for layers in (1, 2):
        model = _drafter_on_device(run, layers)
        for prefix, b in points:
            times[layers, prefix, b] = _timed(_draft_round(run, model, b, prefix), run)
            torch.cuda.empty_cache()
        del model
    for prefix, b in points:
        one, two = times[1, prefix, b], times[2, prefix, b]
        run.emit(
            "drafter",
            {
                "prefix": prefix,
                "batch": b,
                "one_layer_us": one,
                "two_layer_us": two,
                "layer_us": two - one,
                "fixed_us": 2 * one - two,
            },
        )
    drafter_attention_split(run, points)


def _tree_us(fns, topk, b: int, budget: int, run) -> float:
    """The whole greedy tree path of one side (bench/sglang.Side), host-timed as the worker calls it
    (bench sglang's timing: --iters calls per run, median of --reps, the device synchronized around)."""
    from kdtree_engine.bench.sglang import Side, make_inputs

    shape = SimpleNamespace(
        depth=run.shard.drafter.block - 1, vocab=run.shard.model.vocab_size, no_sample=True
    )
    gen = torch.Generator(device=run.device).manual_seed(run.args.seed)
    inputs = make_inputs(b, budget, shape, run.device, gen)
    side = Side(fns, topk, b, budget, run.device)
    call = (inputs["logits"], inputs["roots"], inputs["starts"], inputs["target"])
    side.greedy_path(*call)
    timing = time_host(
        lambda: side.greedy_path(*call), calls=run.args.iters, reps=run.args.reps, sync=run.device
    )
    return timing.median_us


def tree(run) -> None:
    from kdtree_engine.integrations import sglang as ours
    from kdtree_engine.integrations.sglang.topk import whole_vocab_topk

    for b in run.args.batch:
        for budget in run.args.budgets:
            run.emit(
                "tree", {"batch": b, "budget": budget, "us": _tree_us(ours, whole_vocab_topk, b, budget, run)}
            )


def port(run) -> None:
    """The port's tree path per (batch, budget) and its verify attention per (batch, budget, prefix)
    at this GPU's heads, against our backend's, on the same pool and trees (bench/sglang_verify)."""
    from kdtree_engine.bench.peers import load_sglang_port
    from kdtree_engine.bench.sglang_extend import load_extend_attention
    from kdtree_engine.bench.sglang_verify import VerifyGrid, point_bytes, time_point

    peer = load_sglang_port(run.args.port)
    extend = load_extend_attention(run.args.port)
    heads = run.shard.attention_config.num_attention_heads
    grid = VerifyGrid(layers=run.shard.model.num_hidden_layers, rep_ms=run.args.rep_ms)
    for b in run.args.batch:
        for budget in run.args.budgets:
            run.emit(
                "port_tree",
                {"batch": b, "budget": budget, "us": _tree_us(peer.utils, peer.topk, b, budget, run)},
            )
            for prefix in run.args.prefixes:
                if point_bytes(heads, budget + 1, prefix, b) > grid.max_gb * 2**30:
                    print(f"port attention: b={b} budget={budget} prefix={prefix}: over {grid.max_gb} GB")
                    continue
                row = time_point(
                    extend,
                    peer.kernels.compile_ddtree_tree_triton,
                    heads,
                    budget + 1,
                    prefix,
                    b,
                    grid,
                    run.device,
                )
                run.emit("port_attention", row)
                torch.cuda.empty_cache()


SECTIONS = {"layer": layer, "drafter": drafter, "tree": tree, "port": port}
