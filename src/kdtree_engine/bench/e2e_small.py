"""`kdtree-engine bench e2e --target small` (the default; CUDA only): a scaled-down Kimi-K2 shape with
random bf16 weights (`kimi_small_config`: hidden 2048, 12 layers with 1 dense, 16 heads, MLA 512 + 64,
32 routed experts top-6 plus 1 shared, expert width 768, vocab 163840, about 2.5B parameters). Drafter:
the engine's labelled stand-in (`NoisyOracleDrafter`), handed the target's own greedy continuation from
the autoregressive run of the same batch, with a fixed acceptance profile (the true token ranked first
70%, second 15%, third 10%, fourth 5%): it measures the engine, not a drafter. Every batch size runs at
each of `--temperatures` (default 0 and 1); a sampled setting's stand-in follows the autoregressive run
at that temperature.

Per batch size and method the bench reports tokens/s of whole generate() calls (wall clock, bench/e2e.py),
target forwards per token, the mean accepted length tau (root included), the time per round of each
stage (the engine's CUDA events, no syncs), and the round overhead (everything but the verify and draft
stages). Measured in the same run (bench/forward_cost.py, timed with bench/timing.py): per batch size
the decode step and a verify of N = budget + 1 tokens per request (kernels, time, memory roofline) and
the stand-in's draft; c(N) / c(1), the verify's time against the decode step's; the decode step's
roofline (decode / roofline columns); and the engine efficiency = measured speedup / (tau c(1) / c(N)).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kdtree_engine.bench import e2e, forward_cost
from kdtree_engine.bench.plot import markdown_table, plot_series, utc_stamp
from kdtree_engine.bench.timing import device_copy_bandwidth

DRAFTER_LABEL = "the stand-in drafter (NoisyOracleDrafter: a table lookup, not a model)"


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


def _add_costs(rows: list[dict], costs: list[dict]) -> None:
    """c(N) / c(1), tau c(1) / c(N), efficiency and the decode step against its roofline, per row; the
    speedup against the autoregressive row of the same temperature."""
    by_tokens = {c["tokens"]: c for c in costs if c["stage"] != "draft"}
    decode = by_tokens[1]
    ar = {r["temperature"]: r for r in rows if r["method"] == "autoregressive"}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / ar[r["temperature"]]["tokens_per_s"]
        r["decode_ms"], r["roofline_ms"] = decode["us"] * 1e-3, decode["roofline_us"] * 1e-3
        if r["budget"] == "auto":  # no one verify size
            r["c_N_over_c_1"] = r["ideal"] = r["efficiency"] = float("nan")
            continue
        r["c_N_over_c_1"] = by_tokens[r["budget"] + 1]["us"] / decode["us"] if r["budget"] else 1.0
        r["ideal"] = r["tau"] / r["c_N_over_c_1"]
        r["efficiency"] = r["speedup"] / r["ideal"]


def bench_temperature(target, prompts, temperature: float, args, device) -> list[dict]:
    """Rows of every method at one batch size and temperature. The stand-in drafter is handed the
    autoregressive run's continuation at this temperature (the random target's successor margin makes
    it near-deterministic, so sampled runs follow it as greedy ones do); the sampled runs share
    `args.seed`, whose counter-based noise is keyed by position."""
    from kdtree_engine.engine import GenerationConfig, SamplingParams
    from kdtree_engine.engine.demo import NoisyOracleDrafter

    graphs = False if args.eager else None
    base = dict(max_new_tokens=args.new_tokens, impl=args.impl, cuda_graphs=graphs, seed=args.seed,
                sampling=SamplingParams(temperature=temperature),
                row_invariant=getattr(args, "row_invariant", False))  # fmt: skip
    ar_run = e2e.warmed(target, None, prompts, GenerationConfig(method="autoregressive", **base))
    horizon = [list(p) + t for p, t in zip(prompts, ar_run.staged.tokens)]
    drafter = NoisyOracleDrafter(horizon, target.config.vocab_size, block_size=16, device=device)
    auto = [("ddtree", "auto")] if getattr(args, "auto", False) else []
    methods = [("dflash", None)] + [("ddtree", b) for b in args.budgets] + auto
    runs = [
        e2e.warmed(target, drafter, prompts, GenerationConfig(method=m, budget=b, **base)) for m, b in methods
    ]
    ar, *others = (e2e.summarize([out]) for out in e2e.alternate([ar_run, *runs]))  # every row timed in turn
    rows = [{"method": "autoregressive", "budget": 0, "temperature": temperature, **ar}]
    for (method, budget), r in zip(methods, others):
        r["same_as_ar"] = r["tokens"] == ar["tokens"]
        rows.append({"method": method, "budget": budget if budget is not None else 15,
                     "temperature": temperature, **r})  # fmt: skip
    return rows


def bench_batch(target, batch: int, args, device) -> tuple[list[dict], list[dict]]:
    """(rows of every method and temperature at this batch size, forward cost rows)."""
    from kdtree_engine.engine.demo import NoisyOracleDrafter

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, target.config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
    rows = [r for t in args.temperatures for r in bench_temperature(target, prompts, t, args, device)]
    prefix = args.prompt_len + args.new_tokens // 2
    tokens = sorted({r["budget"] + 1 for r in rows if r["budget"] and r["budget"] != "auto"})
    # the draft stage's cost does not depend on the stand-in's table: the prompts alone will do
    drafter = NoisyOracleDrafter(prompts, target.config.vocab_size, block_size=16, device=device)
    costs = forward_cost.cost_rows(target, drafter, batch, tokens, prefix, args.impl, args.copy_bw)
    for r in rows:
        r["batch"] = batch
        del r["tokens"]
    _add_costs(rows, costs)
    return rows, costs


def markdown(rows: list[dict], header: str, forwards: list[dict] | None = None) -> str:
    heads = ["batch", "temperature", "method", "budget", "tokens/s", "speedup", "tau", "fwd/token",
             "c(N)/c(1)", "efficiency", "round ms", "overhead", "same as AR"]  # fmt: skip
    body = [
        [r["batch"], f"{r['temperature']:g}", r["method"], r["budget"] or "-", r["tokens_per_s"],
         f"{r['speedup']:.2f}x",
         f"{r['tau']:.2f}", f"{r['forwards_per_token']:.3f}", f"{r['c_N_over_c_1']:.2f}",
         f"{r['efficiency']:.2f}", f"{r['round_ms']:.2f}", f"{100 * r['overhead']:.0f}%",
         "yes" if r.get("same_as_ar", True) else "no"]
        for r in rows
    ]  # fmt: skip
    lead = ["batch", "temperature"]

    def setting(r):
        return [r["batch"], f"{r['temperature']:g}"]

    stages = e2e.stage_table(
        rows, lead + ["method", "budget"], lambda r: setting(r) + [r["method"], r["budget"] or "-"]
    )
    roof = sorted({(r["batch"], r["decode_ms"], r["roofline_ms"]) for r in rows})
    roof_rows = [[b, f"{d:.3f}", f"{m:.3f}", f"{d / m:.2f}x"] for b, d, m in roof]
    parts = [
        header, markdown_table(heads, body), "Per-stage time per round:", stages,
        "Decode step against its memory roofline:",
        markdown_table(["batch", "decode ms", "roofline ms", "decode / roofline"], roof_rows),
    ]  # fmt: skip
    auto = e2e.auto_table(rows, lead, setting)
    if auto:
        parts += ['Budget "auto": the rounds per bucket, predicted and observed tokens per request:', auto]
    costs = e2e.round_cost_table(rows, lead + ["method", "budget"],
                                 lambda r: setting(r) + [r["method"], r["budget"] or "-"])  # fmt: skip
    if costs:
        parts += [e2e.ROUND_COSTS_TITLE, costs]
    if forwards:
        parts.append(forward_cost.markdown(forwards, DRAFTER_LABEL))
    return "\n\n".join(parts)


def plot(rows: list[dict], path: Path) -> None:
    """Tokens/s per batch size, one line per method (DDTree: per budget)."""
    batches = sorted({r["batch"] for r in rows})
    series: dict[str, list] = {}
    for r in rows:
        name = (
            r["method"] + (f" {r['budget']}" if r["method"] == "ddtree" else "") + f" T={r['temperature']:g}"
        )
        series.setdefault(name, [None] * len(batches))[batches.index(r["batch"])] = r["tokens_per_s"]
    title = "bench e2e: tokens/s, scaled-down Kimi shape, bf16, stand-in drafter"
    plot_series(path, title, [f"batch {b}" for b in batches], series, ylabel="tokens/s")


def main(args: argparse.Namespace, device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(
            "--target small: the 2.5B-parameter random target runs on a CUDA GPU only "
            f"(device: {device}); on the CPU use --target nano"
        )
    stamp = utc_stamp()
    config = kimi_small_config(num_hidden_layers=args.layers)
    t0 = time.perf_counter()
    target = random_target(config, device)
    args.copy_bw = device_copy_bandwidth(device)
    header = (
        f"bench e2e, {torch.cuda.get_device_name(device)}, {stamp}, torch {torch.__version__}, bf16, "
        f"scaled-down Kimi shape ({args.layers} layers, random weights), stand-in drafter; prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens; {e2e.CAPTURE_NOTE}; "
        f"copy {args.copy_bw / 1e9:.0f} GB/s (read + written)"
    )
    print(header, f"(target built in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows: list[dict] = []
    costs: list[dict] = []
    for batch in e2e.batch_sizes(args, device):
        batch_rows, batch_costs = bench_batch(target, batch, args, device)
        for r in batch_rows:
            rows.append(r)
            e2e.print_row(r)
        costs += batch_costs
        e2e.report(rows, header, args.out, forwards=costs)  # per batch size: a cut run keeps what it measured
    print(markdown(rows, header, costs))
    return 0
