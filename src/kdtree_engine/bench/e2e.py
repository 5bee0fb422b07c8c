"""`kdtree-engine bench e2e`: whole generation runs, autoregressive against DFlash and DDTree.

Target: a scaled-down Kimi-K2 shape with random bf16 weights (`kimi_small_config`: hidden 2048, 12
layers with 1 dense, 16 heads, MLA 512 + 64, 32 routed experts top-6 plus 1 shared, expert width 768,
vocab 163840, about 2.5B parameters). Drafter: the engine's labelled stand-in (`NoisyOracleDrafter`),
handed the target's own greedy continuation from the autoregressive run of the same batch, with a
fixed acceptance profile (the true token ranked first 70%, second 15%, third 10%, fourth 5%): it
measures the engine, not a drafter.

Per batch size and method the bench reports tokens/s of whole generate() calls (prefill included; the
one-time CUDA graph capture excluded, as a server captures at start-up; it is reported apart), target
forwards per token, the mean accepted length tau (root included), the time per round of each stage
(CUDA events, no syncs), and the round overhead (everything but the verify and draft stages). Measured
in the same run: the cost c(N) of a captured verify forward of N tokens per request against c(1), the
decode step's memory roofline (the bytes one decode step must read / the device's copy bandwidth,
bytes read plus written per second), and
the engine efficiency = measured speedup / (tau * c(1) / c(N)) with N = budget + 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table, plot_series

CAPTURE_NOTE = "tokens/s excludes the one-time graph capture (column capture_s)"


def kimi_small_config(**overrides):
    """The scaled-down Kimi-K2 shape the engine is benchmarked on (random weights)."""
    from kdtree_engine.model.config import ModelConfig

    fields = dict(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=32,
        n_shared_experts=1,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        max_position_embeddings=4096,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@torch.no_grad()
def random_target(config, device, dtype=torch.bfloat16, seed: int = 0, successor_scale: float = 4.0):
    """The target with seeded random weights drawn on the device (fan-in scaled normals, norms near 1,
    a small router bias): quick to build at billions of parameters.

    A random model's top two logits are often closer than bf16 rounding, so a verify forward of N tokens
    and a decode step would choose different tokens and any drafter stand-in given the decode's output
    would fall off it. So lm_head row succ(v) is set to the embedding of v (times `successor_scale`, a
    fixed random permutation succ) and the embeddings are scaled up: the greedy continuation then
    follows succ with a margin far above rounding, whatever the layers add. The weights' sizes, the
    routing and so the cost of every forward are those of the random model."""
    from kdtree_engine.model.model import DeepseekV3ForCausalLM

    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight") or "layernorm" in name:
            p.normal_(1.0, 0.1, generator=gen)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.1, generator=gen)
    if successor_scale:
        emb = model.embed_tokens.weight
        emb.mul_(successor_scale)
        succ = torch.randperm(config.vocab_size, generator=gen, device=device)
        model.lm_head.weight[succ] = emb / config.hidden_size**0.5
    return model.to(dtype).eval()


def decode_bytes(model, batch: int, seqlen: int) -> float:
    """Bytes one decode step must read: every weight except the embedding table (one row per token)
    and the routed experts (per MoE layer, the experts the batch is expected to touch under uniform
    routing: E (1 - (1 - k/E)^batch)), plus the latent cache rows of every request."""
    c = model.config
    total, expert_bytes = 0, 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.startswith("embed_tokens"):
            total += batch * c.hidden_size * p.element_size()
        elif ".experts." in name:
            expert_bytes += size
        else:
            total += size
    touched = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch)
    total += expert_bytes * touched / c.n_routed_experts
    cache = c.num_hidden_layers * batch * seqlen * c.latent_dim * model.dtype.itemsize
    return float(total + cache)


def copy_bandwidth(device) -> float:
    """Bytes moved per second (read + written) by a large device-to-device copy: the rate at which a
    kernel that only reads could read at best."""
    from triton.testing import do_bench

    src = torch.empty(1 << 29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def verify_cost(model, batch: int, nodes: int, prefix: int, impl) -> float:
    """Seconds of one captured target forward of `nodes` tokens per request (random tree visibility,
    a prefix of `prefix` cached rows): the median of graph replays."""
    from triton.testing import do_bench

    dev = model.device
    cache = model.new_cache(batch, prefix + nodes + 1)
    cache.kv.normal_()
    cache.seqlens.fill_(prefix)
    ids = torch.randint(0, model.config.vocab_size, (batch, nodes), device=dev)
    vis = torch.ones(nodes, nodes, dtype=torch.bool, device=dev).tril().expand(batch, nodes, nodes)

    def forward():
        cache.seqlens.fill_(prefix)
        model(ids, cache, visibility=vis, impl=impl, validate=False)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return do_bench(graph.replay, rep=100, return_mode="median") * 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12, help="target layers (the shape's 12 by default)")
    parser.add_argument("--impl", choices=("triton", "hopper"), default=None)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--out", type=Path, default=Path("out/e2e"))


def _run(target, drafter, prompts, config) -> dict:
    """One timed generate() call, after an identical one that compiles the kernels for its shapes."""
    from kdtree_engine.engine import generate

    generate(target, drafter, prompts, config)
    out = generate(target, drafter, prompts, config)
    s = out.stats
    wall = s.wall_time - s.capture_time
    rounds = max(s.rounds, 1)
    per_round = {k: v / rounds * 1e3 for k, v in s.stage_times.items() if k != "prefill"}
    round_ms = sum(per_round.values())
    core = per_round.get("verify", 0.0) + per_round.get("draft", 0.0)
    return {
        "tokens": out.tokens,
        "tokens_per_s": s.total_new_tokens / wall,
        "forwards_per_token": s.target_forwards / max(s.total_new_tokens, 1),
        "tau": s.mean_accept_len,
        "capture_s": s.capture_time,
        "round_ms": round_ms,
        "stages_ms": per_round,
        "overhead": (round_ms - core) / round_ms if round_ms else float("nan"),
        "graphs": s.cuda_graphs,
    }


def bench_batch(target, batch: int, args, device) -> list[dict]:
    from kdtree_engine.engine import GenerationConfig
    from kdtree_engine.engine.demo import NoisyOracleDrafter

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, target.config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
    graphs = False if args.eager else None
    base = dict(max_new_tokens=args.new_tokens, impl=args.impl, cuda_graphs=graphs)
    ar = _run(target, None, prompts, GenerationConfig(method="autoregressive", **base))
    horizon = [list(p) + t for p, t in zip(prompts, ar["tokens"])]
    drafter = NoisyOracleDrafter(horizon, target.config.vocab_size, block_size=16, device=device)
    rows = [{"method": "autoregressive", "budget": 0, **ar}]
    runs = [("dflash", None)] + [("ddtree", b) for b in args.budgets]
    for method, budget in runs:
        r = _run(target, drafter, prompts, GenerationConfig(method=method, budget=budget, **base))
        r["same_as_ar"] = r["tokens"] == ar["tokens"]
        rows.append({"method": method, "budget": budget if budget is not None else 15, **r})
    prefix = args.prompt_len + args.new_tokens // 2
    c1 = verify_cost(target, batch, 1, prefix, args.impl)
    for r in rows:
        r["batch"] = batch
        r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"]
        n = r["budget"] + 1
        r["c_N_over_c_1"] = verify_cost(target, batch, n, prefix, args.impl) / c1 if n > 1 else 1.0
        r["ideal"] = r["tau"] / r["c_N_over_c_1"]
        r["efficiency"] = r["speedup"] / r["ideal"]
        del r["tokens"]
    roof = decode_bytes(target, batch, prefix) / args.copy_bw
    for r in rows:
        r["decode_ms"] = c1 * 1e3
        r["roofline_ms"] = roof * 1e3
    return rows


def markdown(rows: list[dict], header: str) -> str:
    heads = ["batch", "method", "budget", "tokens/s", "speedup", "tau", "fwd/token", "c(N)/c(1)",
             "efficiency", "round ms", "overhead", "same as AR"]  # fmt: skip
    body = [
        [
            r["batch"],
            r["method"],
            r["budget"] or "-",
            r["tokens_per_s"],
            f"{r['speedup']:.2f}x",
            f"{r['tau']:.2f}",
            f"{r['forwards_per_token']:.3f}",
            f"{r['c_N_over_c_1']:.2f}",
            f"{r['efficiency']:.2f}",
            f"{r['round_ms']:.2f}",
            f"{100 * r['overhead']:.0f}%",
            "yes" if r.get("same_as_ar", True) else "no",
        ]  # fmt: skip
        for r in rows
    ]
    stages = ["batch", "method", "budget"] + [
        f"{k} ms" for k in ("draft", "tree_build", "compile", "verify", "accept", "commit")
    ]
    stage_rows = [
        [r["batch"], r["method"], r["budget"] or "-"]
        + [
            f"{r['stages_ms'].get(k, 0.0):.3f}"
            for k in ("draft", "tree_build", "compile", "verify", "accept", "commit")
        ]
        for r in rows
    ]
    roof = sorted({(r["batch"], r["decode_ms"], r["roofline_ms"]) for r in rows})
    roof_rows = [[b, f"{d:.3f}", f"{m:.3f}", f"{d / m:.2f}x"] for b, d, m in roof]
    return "\n\n".join([
        header, markdown_table(heads, body), "Per-stage time per round:", markdown_table(stages, stage_rows),
        "Decode step against its memory roofline:",
        markdown_table(["batch", "decode ms", "roofline ms", "decode / roofline"], roof_rows),
    ])  # fmt: skip


def report(rows: list[dict], header: str, out: Path) -> None:
    """e2e.json, e2e.md and e2e.png (tokens/s per batch size and method) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    (out / "e2e.md").write_text(markdown(rows, header))
    batches = sorted({r["batch"] for r in rows})
    series: dict[str, list] = {}
    for r in rows:
        name = r["method"] + (f" {r['budget']}" if r["method"] == "ddtree" else "")
        series.setdefault(name, [None] * len(batches))[batches.index(r["batch"])] = r["tokens_per_s"]
    title = "bench e2e: tokens/s, scaled-down Kimi shape, bf16, stand-in drafter"
    plot_series(out / "e2e.png", title, [f"batch {b}" for b in batches], series, ylabel="tokens/s")


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench e2e: needs a CUDA GPU", file=__import__("sys").stderr)
        return 2
    device = torch.device("cuda")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    config = kimi_small_config(num_hidden_layers=args.layers)
    t0 = time.perf_counter()
    target = random_target(config, device)
    args.copy_bw = copy_bandwidth(device)
    header = (
        f"bench e2e, {torch.cuda.get_device_name(device)}, {stamp}, torch {torch.__version__}, bf16, "
        f"scaled-down Kimi shape ({args.layers} layers, random weights), stand-in drafter; prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens; {CAPTURE_NOTE}; copy {args.copy_bw / 1e9:.0f} GB/s (read + written)"
    )
    print(header, f"(target built in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows: list[dict] = []
    for batch in args.batch:
        for r in bench_batch(target, batch, args, device):
            rows.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        report(rows, header, args.out)  # rewritten per batch size: a cut run keeps what it measured
    print(markdown(rows, header))
    return 0
