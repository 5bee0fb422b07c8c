"""`kdtree-engine bench e2e`: whole generation runs, autoregressive against DFlash and DDTree, on one
of two targets (`--target`).

`small` (default, CUDA only): a scaled-down Kimi-K2 shape with random bf16 weights (`kimi_small_config`:
hidden 2048, 12 layers with 1 dense, 16 heads, MLA 512 + 64, 32 routed experts top-6 plus 1 shared,
expert width 768, vocab 163840, about 2.5B parameters). Drafter: the engine's labelled stand-in
(`NoisyOracleDrafter`), handed the target's own greedy continuation from the autoregressive run of the
same batch, with a fixed acceptance profile (the true token ranked first 70%, second 15%, third 10%,
fourth 5%): it measures the engine, not a drafter.

Per batch size and method the bench reports tokens/s of whole generate() calls (prefill included; the
one-time CUDA graph capture excluded, as a server captures at start-up; it is reported apart), target
forwards per token, the mean accepted length tau (root included), the time per round of each stage
(CUDA events, no syncs), and the round overhead (everything but the verify and draft stages). Measured
in the same run: the cost c(N) of a captured verify forward of N tokens per request against c(1), the
decode step's memory roofline (the bytes one decode step must read / the device's copy bandwidth,
bytes read plus written per second), and
the engine efficiency = measured speedup / (tau * c(1) / c(N)) with N = budget + 1.

`nano` (CPU in float32 or GPU in bf16): the shipped trained kimi-nano target (`assets.KIMI_NANO`) and a
DFlash drafter (`--drafter`: the trained one by default, or `random`), on the first `--prompts`
held-out code-completion prompts. Per batch size (batch b runs the prompts b at a time, ragged, cycling
through them to fill the last batch) and temperature: autoregressive, DFlash and DDTree at each budget,
every request decoding exactly `--new-tokens` tokens (EOS ignored), every sampled run with the same
seed. Per row: tokens/s, speedup over autoregressive decoding at the same temperature and batch, tau,
target forwards per token and, at temperature 0, how many requests equal autoregressive decoding token
for token. Then `bench.experts`: the distinct routed experts a verify forward touches per MoE layer
against uniform routing.

Every timed generate() call follows an identical untimed one (kernel compilation, caches warm).
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
TARGETS = ("small", "nano")


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
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default="small",
        help="small: 2.5B random Kimi shape (CUDA); nano: kimi-nano",
    )
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes (default: 1 for nano on the CPU, else 1 4 16 64)",
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64], help="DDTree budgets")
    parser.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (small)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12, help="target layers (small; the shape's 12)")
    parser.add_argument("--impl", choices=("triton", "hopper"), default=None)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--out", type=Path, default=Path("out/e2e"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    drafter = "nano: a DFlash drafter dir, or 'random' (untrained); default: assets/kimi-nano-dflash"
    parser.add_argument("--drafter", default=None, help=drafter)
    parser.add_argument("--prompts", type=int, default=8, help="nano: held-out prompts to run")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="nano (0 = greedy)")
    parser.add_argument("--seed", type=int, default=0, help="nano: the seed of every sampled run")


def resolve_device(name: str | None) -> torch.device:
    """--device as a torch.device: cuda when there is one by default; ValueError for cuda without one."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: expected cpu or cuda, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is available here")
    return device


def batch_sizes(args, device: torch.device) -> list[int]:
    """--batch, or its default: 1 for nano on the CPU, else 1 4 16 64."""
    if args.batch is not None:
        if any(b < 1 for b in args.batch):
            raise ValueError(f"--batch: expected sizes >= 1, got {args.batch}")
        return list(args.batch)
    return [1] if args.target == "nano" and device.type == "cpu" else [1, 4, 16, 64]


def _timed(target, drafter, prompts, config):
    """One timed generate() call (GenerationOutput), after an identical one that compiles the kernels for
    its shapes."""
    from kdtree_engine.engine import generate

    generate(target, drafter, prompts, config)
    return generate(target, drafter, prompts, config)


def summarize(outputs) -> dict:
    """The measures of timed generate() calls taken together: tokens/s over their summed wall time less
    graph capture, target forwards per token, tau over every (request, round), time per round of each
    stage; `tokens`: the outputs' token lists, concatenated."""
    stats = [o.stats for o in outputs]
    wall = sum(s.wall_time - s.capture_time for s in stats)
    new_tokens = sum(s.total_new_tokens for s in stats)
    rounds = max(sum(s.rounds for s in stats), 1)
    stage_times: dict[str, float] = {}
    for s in stats:
        for k, v in s.stage_times.items():
            stage_times[k] = stage_times.get(k, 0.0) + v
    accepted = [n for s in stats for n in s.accept_lengths]
    per_round = {k: v / rounds * 1e3 for k, v in stage_times.items() if k != "prefill"}
    round_ms = sum(per_round.values())
    core = per_round.get("verify", 0.0) + per_round.get("draft", 0.0)
    return {
        "tokens": [t for o in outputs for t in o.tokens],
        "tokens_per_s": new_tokens / wall,
        "forwards_per_token": sum(s.target_forwards for s in stats) / max(new_tokens, 1),
        "tau": sum(accepted) / len(accepted) if accepted else 1.0,
        "capture_s": sum(s.capture_time for s in stats),
        "round_ms": round_ms,
        "stages_ms": per_round,
        "overhead": (round_ms - core) / round_ms if round_ms else float("nan"),
        "graphs": all(s.cuda_graphs for s in stats),
    }


def _run(target, drafter, prompts, config) -> dict:
    """One timed generate() call, after an identical one that compiles the kernels for its shapes."""
    return summarize([_timed(target, drafter, prompts, config)])


def _print_row(r: dict) -> None:
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)


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


def prompt_batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts b at a time: ceil(len / b) batches of exactly b prompts, cycling through the prompts
    to fill the last one (so a batch larger than the prompt count repeats prompts)."""
    count = -(-len(prompts) // batch)
    return [[prompts[(i * batch + j) % len(prompts)] for j in range(batch)] for i in range(count)]


def nano_runs(budgets) -> list[tuple[str, int | None]]:
    """(method, budget) in bench order: autoregressive first (the baseline), DFlash, DDTree per budget."""
    return [("autoregressive", None), ("dflash", None)] + [("ddtree", b) for b in budgets]


def bench_nano_setting(target, drafter, groups, batch: int, temperature: float, args) -> list[dict]:
    """Rows of every method at one batch size and temperature; speedups against this setting's
    autoregressive row, greedy outputs compared with it request by request."""
    from kdtree_engine.engine import GenerationConfig, SamplingParams

    graphs = False if args.eager else None
    base = dict(max_new_tokens=args.new_tokens, impl=args.impl, cuda_graphs=graphs, seed=args.seed,
                sampling=SamplingParams(temperature=temperature))  # fmt: skip
    rows, ar, ar_tokens = [], None, None
    for method, budget in nano_runs(args.budgets):
        config = GenerationConfig(method=method, budget=budget, **base)
        speculative = method != "autoregressive"
        r = summarize([_timed(target, drafter if speculative else None, g, config) for g in groups])
        tokens = r.pop("tokens")
        if ar is None:  # the first run: autoregressive decoding, the baseline
            ar, ar_tokens = r, tokens
        equal = sum(a == b for a, b in zip(tokens, ar_tokens)) if temperature == 0 else None
        budget = config.tree_budget(drafter.block_size if speculative else 1)
        rows.append({"target": "nano", "method": method, "budget": budget, "temperature": temperature,
                     "batch": batch, "requests": len(tokens), **r,
                     "speedup": r["tokens_per_s"] / ar["tokens_per_s"], "equal_to_ar": equal})  # fmt: skip
    return rows


def bench_nano(target, drafter, prompts: list[list[int]], args, device, on_row=None) -> list[dict]:
    """Every batch size and temperature (nano rows; on_row(rows so far, row) after each row)."""
    rows: list[dict] = []
    for batch in batch_sizes(args, device):
        groups = prompt_batches(prompts, batch)
        for temperature in args.temperatures:
            for r in bench_nano_setting(target, drafter, groups, batch, temperature, args):
                rows.append(r)
                if on_row is not None:
                    on_row(rows, r)
    return rows


STAGE_KEYS = ("draft", "tree_build", "compile", "verify", "accept", "commit")


def stage_table(rows: list[dict], lead_heads: list[str], lead) -> str:
    """Per-stage ms per round, after the leading cells lead(row)."""
    heads = lead_heads + [f"{k} ms" for k in STAGE_KEYS]
    body = [list(lead(r)) + [f"{r['stages_ms'].get(k, 0.0):.3f}" for k in STAGE_KEYS] for r in rows]
    return markdown_table(heads, body)


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
    stages = stage_table(
        rows, ["batch", "method", "budget"], lambda r: [r["batch"], r["method"], r["budget"] or "-"]
    )
    roof = sorted({(r["batch"], r["decode_ms"], r["roofline_ms"]) for r in rows})
    roof_rows = [[b, f"{d:.3f}", f"{m:.3f}", f"{d / m:.2f}x"] for b, d, m in roof]
    return "\n\n".join([
        header, markdown_table(heads, body), "Per-stage time per round:", stages,
        "Decode step against its memory roofline:",
        markdown_table(["batch", "decode ms", "roofline ms", "decode / roofline"], roof_rows),
    ])  # fmt: skip


def _equal_cell(r: dict) -> str:
    return "-" if r["equal_to_ar"] is None else f"{r['equal_to_ar']}/{r['requests']}"


def nano_markdown(rows: list[dict], header: str, experts: list[dict] | None = None) -> str:
    """The nano rows (equal to AR: requests whose greedy output is autoregressive decoding's, token
    for token), their per-stage times, and the expert touch table when given."""
    from kdtree_engine.bench import experts as touch

    heads = ["batch", "temperature", "method", "budget", "tokens/s", "speedup", "tau", "fwd/token",
             "round ms", "equal to AR"]  # fmt: skip
    body = [
        [r["batch"], f"{r['temperature']:g}", r["method"], r["budget"] or "-", r["tokens_per_s"],
         f"{r['speedup']:.2f}x", f"{r['tau']:.2f}", f"{r['forwards_per_token']:.3f}", f"{r['round_ms']:.2f}",
         _equal_cell(r)]
        for r in rows
    ]  # fmt: skip
    lead = ["batch", "temperature", "method", "budget"]
    stages = stage_table(
        rows, lead, lambda r: [r["batch"], f"{r['temperature']:g}", r["method"], r["budget"] or "-"]
    )
    parts = [header, markdown_table(heads, body), "Per-stage time per round:", stages]
    if experts:
        parts.append(touch.markdown(experts))
    return "\n\n".join(parts)


def _plot_small(rows: list[dict], path: Path) -> None:
    batches = sorted({r["batch"] for r in rows})
    series: dict[str, list] = {}
    for r in rows:
        name = r["method"] + (f" {r['budget']}" if r["method"] == "ddtree" else "")
        series.setdefault(name, [None] * len(batches))[batches.index(r["batch"])] = r["tokens_per_s"]
    title = "bench e2e: tokens/s, scaled-down Kimi shape, bf16, stand-in drafter"
    plot_series(path, title, [f"batch {b}" for b in batches], series, ylabel="tokens/s")


def _plot_nano(rows: list[dict], path: Path) -> None:
    """Speedup over autoregressive decoding against the budget: one line per method, temperature and
    batch (DFlash is one point at its chain length)."""
    budgets = sorted({r["budget"] for r in rows if r["method"] != "autoregressive"})
    series: dict[str, list] = {}
    for r in rows:
        if r["method"] != "autoregressive":
            name = f"{r['method']} T={r['temperature']:g} batch {r['batch']}"
            series.setdefault(name, [None] * len(budgets))[budgets.index(r["budget"])] = r["speedup"]
    if not series:  # autoregressive rows only, so far
        return
    title = "bench e2e --target nano: speedup over autoregressive decoding"
    plot_series(path, title, [f"budget {b}" for b in budgets], series, ylabel="speedup", logy=False)


def report(rows: list[dict], header: str, out: Path, *, target: str = "small", experts=None) -> None:
    """Under `out`: e2e.json, e2e.md and e2e.png (small: tokens/s per batch size and method), or
    e2e_nano.json (rows, and the expert touch rows when given), e2e_nano.md and e2e_nano.png (nano:
    speedup against the budget)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = "e2e" if target == "small" else "e2e_nano"
    payload = {"header": header, "rows": rows}
    if experts is not None:
        payload["experts"] = experts
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    if target == "small":
        (out / f"{stem}.md").write_text(markdown(rows, header))
        _plot_small(rows, out / f"{stem}.png")
    else:
        (out / f"{stem}.md").write_text(nano_markdown(rows, header, experts))
        _plot_nano(rows, out / f"{stem}.png")


def main_small(args: argparse.Namespace, device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(
            "--target small: the 2.5B-parameter random target runs on a CUDA GPU only "
            f"(device: {device}); on the CPU use --target nano"
        )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    config = kimi_small_config(num_hidden_layers=args.layers)
    t0 = time.perf_counter()
    target = random_target(config, device)
    args.copy_bw = copy_bandwidth(device)
    header = (
        f"bench e2e, {torch.cuda.get_device_name(device)}, {stamp}, torch {torch.__version__}, bf16, "
        f"scaled-down Kimi shape ({args.layers} layers, random weights), stand-in drafter; prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens; {CAPTURE_NOTE}; "
        f"copy {args.copy_bw / 1e9:.0f} GB/s (read + written)"
    )
    print(header, f"(target built in {time.perf_counter() - t0:.1f} s)", flush=True)
    rows: list[dict] = []
    for batch in batch_sizes(args, device):
        for r in bench_batch(target, batch, args, device):
            rows.append(r)
            _print_row(r)
        report(rows, header, args.out)  # rewritten per batch size: a cut run keeps what it measured
    print(markdown(rows, header))
    return 0


def nano_prompts(count: int) -> list[list[int]]:
    """The first `count` held-out code-completion prompts of kimi-nano, as token ids."""
    from kdtree_engine.assets import KIMI_NANO, heldout_prompts
    from kdtree_engine.engine.tokenizer import load_tokenizer

    texts = [p["text"] for p in heldout_prompts()]
    if not 1 <= count <= len(texts):
        raise ValueError(f"--prompts: expected 1 to {len(texts)} (the held-out prompts), got {count}")
    tokenizer = load_tokenizer(KIMI_NANO)
    return [tokenizer.encode(t) for t in texts[:count]]


def drafter_path(spec: str | None) -> Path | None:
    """--drafter as a checked checkpoint directory (default: the shipped kimi-nano drafter), None for
    "random"; FileNotFoundError with what to do when the directory is not there (engine.checkpoint's
    checks otherwise)."""
    from kdtree_engine.assets import KIMI_NANO_DFLASH
    from kdtree_engine.engine.checkpoint import checkpoint_dir

    if spec == "random":
        return None
    path = Path(spec) if spec is not None else KIMI_NANO_DFLASH
    if not path.exists():
        raise FileNotFoundError(
            f"--drafter: {path} does not exist (the trained kimi-nano drafter comes from "
            "`kdtree-engine train drafter`); pass --drafter DIR, or --drafter random for an untrained one"
        )
    return checkpoint_dir(path, "--drafter", drafter=True)


def nano_drafter(path: Path | None, target, mask_token_id: int):
    """(drafter, label): the DFlash drafter at `path`, or for None a seeded untrained one of the trained
    drafter's block size (it accepts almost nothing: tau near 1)."""
    from kdtree_engine.drafter import load_drafter, random_drafter, tiny_drafter_config

    if path is None:
        config = tiny_drafter_config(target.config, block_size=16, mask_token_id=mask_token_id)
        drafter = random_drafter(config, seed=0, dtype=target.dtype, device=target.device)
        return drafter, "random DFlash drafter (untrained: tau near 1)"
    return load_drafter(path, dtype=target.dtype, device=target.device), f"DFlash drafter {path.name}"


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def main_nano(args: argparse.Namespace, device: torch.device) -> int:
    from kdtree_engine.assets import KIMI_NANO
    from kdtree_engine.bench import experts
    from kdtree_engine.engine.tokenizer import load_tokenizer
    from kdtree_engine.model import load_model

    t0 = time.perf_counter()
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens: expected >= 1, got {args.new_tokens}")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    prompts = nano_prompts(args.prompts)
    batch_sizes(args, device)  # bad arguments fail before anything is loaded
    path = drafter_path(args.drafter)
    target = load_model(KIMI_NANO, dtype=dtype, device=device)
    drafter, drafter_label = nano_drafter(path, target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    c = target.config
    params = sum(p.numel() for p in target.parameters())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lengths = [len(p) for p in prompts]
    header = (
        f"bench e2e --target nano, {device_label(device)}, {stamp}, torch {torch.__version__}, "
        f"{str(dtype).removeprefix('torch.')}, kimi-nano ({c.num_hidden_layers} layers, {params / 1e6:.1f}M "
        f"parameters, trained), {drafter_label} (block size {drafter.block_size}); {len(prompts)} held-out "
        f"prompts ({min(lengths)}-{max(lengths)} tokens), {args.new_tokens} new tokens per request (EOS "
        f"ignored), seed {args.seed}" + (f"; {CAPTURE_NOTE}" if device.type == "cuda" else "")
    )
    print(header, flush=True)

    def progress(rows, row):
        _print_row(row)
        report(rows, header, args.out, target="nano")  # a cut run keeps what it measured

    rows = bench_nano(target, drafter, prompts, args, device, on_row=progress)
    touches = experts.touch_rows(target, drafter, prompts, args.budgets, args.new_tokens, args.impl)
    report(rows, header, args.out, target="nano", experts=touches)
    print(nano_markdown(rows, header, touches))
    print(f"bench e2e --target nano: {time.perf_counter() - t0:.1f} s in all", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    return main_small(args, device) if args.target == "small" else main_nano(args, device)
