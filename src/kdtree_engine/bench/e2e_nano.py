"""`kdtree-engine bench e2e --target nano` (CPU in float32 or GPU in bf16): the shipped trained kimi-nano
target (`assets.KIMI_NANO`) and a DFlash drafter (`--drafter`: the trained one by default, or `random`),
on the first `--prompts` held-out code-completion prompts.

Per batch size (batch b runs the prompts b at a time, ragged, cycling through them to fill the last
batch) and temperature: autoregressive, DFlash and DDTree at each budget, every request decoding exactly
`--new-tokens` tokens (EOS ignored), every sampled run with the same seed. Per row: tokens/s (wall clock
of whole generate() calls, bench/e2e.py), speedup over autoregressive decoding at the same temperature
and batch, tau, target forwards per token and, at temperature 0, how many requests equal autoregressive
decoding token for token at the same batch and, after a batch-1 setting, their prompt decoded alone.
Then `bench.experts`: the distinct routed experts a verify forward touches per MoE layer against
uniform routing. On CUDA, per batch size (bench/forward_cost.py, timed with
bench/timing.py): kernels and time of the decode step and of a verify of N = budget + 1 tokens (and of
DFlash's block) against their memory rooflines, and the drafter's draft against the decode step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kdtree_engine.bench import e2e, forward_cost
from kdtree_engine.bench.plot import markdown_table, plot_series, utc_stamp


def prompt_batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts b at a time: ceil(len / b) batches of exactly b prompts, cycling through the prompts
    to fill the last one (so a batch larger than the prompt count repeats prompts)."""
    count = -(-len(prompts) // batch)
    return [[prompts[(i * batch + j) % len(prompts)] for j in range(batch)] for i in range(count)]


def runs(budgets, auto: bool = False) -> list[tuple[str, int | str | None]]:
    """(method, budget) in bench order: autoregressive first (the baseline), DFlash, DDTree per budget,
    then DDTree with budget "auto" when asked."""
    return (
        [("autoregressive", None), ("dflash", None)]
        + [("ddtree", b) for b in budgets]
        + ([("ddtree", "auto")] if auto else [])
    )


def bench_setting(
    target, drafter, groups, batch: int, temperature: float, args, alone: list | None = None
) -> tuple[list[dict], list]:
    """(rows of every method at one batch size and temperature, the autoregressive run's tokens):
    speedups against this setting's autoregressive row, greedy outputs compared with it request by
    request and, given `alone` (the greedy autoregressive tokens of each prompt decoded alone, batch 1),
    with their prompt's alone run (row k of the flattened groups runs prompt k mod len(alone))."""
    from kdtree_engine.engine import GenerationConfig, SamplingParams

    graphs = False if args.eager else None
    base = dict(max_new_tokens=args.new_tokens, impl=args.impl, cuda_graphs=graphs, seed=args.seed,
                sampling=SamplingParams(temperature=temperature),
                row_invariant=getattr(args, "row_invariant", False))  # fmt: skip
    configs = [
        GenerationConfig(method=m, budget=b, **base)
        for m, b in runs(args.budgets, getattr(args, "auto", False))
    ]
    specs = [(drafter if c.method != "autoregressive" else None, c) for c in configs]
    per_group = [e2e.timed_runs(target, specs, g) for g in groups]  # each group's rows timed in turn
    rows, ar, ar_tokens = [], None, None
    for i, config in enumerate(configs):
        method, speculative = config.method, config.method != "autoregressive"
        r = e2e.summarize([outs[i] for outs in per_group])
        tokens = r.pop("tokens")
        if ar is None:  # the first run: autoregressive decoding, the baseline
            ar, ar_tokens = r, tokens
        equal = sum(a == b for a, b in zip(tokens, ar_tokens)) if temperature == 0 else None
        same_alone = _same_as_alone(tokens, alone) if temperature == 0 else None
        block = drafter.block_size if speculative else 1
        budget = "auto" if config.auto_budget else config.tree_budget(block)
        rows.append({"target": "nano", "method": method, "budget": budget, "temperature": temperature,
                     "batch": batch, "requests": len(tokens), **r,
                     "speedup": r["tokens_per_s"] / ar["tokens_per_s"], "equal_to_ar": equal,
                     "equal_alone": same_alone})  # fmt: skip
    return rows, ar_tokens


def _same_as_alone(tokens: list, alone: list | None) -> int | None:
    """How many requests got their prompt's tokens decoded alone (request k runs prompt k mod
    len(alone)); None without an alone run."""
    if alone is None:
        return None
    return sum(t == alone[k % len(alone)] for k, t in enumerate(tokens))


def bench(target, drafter, prompts: list[list[int]], args, device, on_row=None) -> list[dict]:
    """Every batch size and temperature (nano rows; on_row(rows so far, row) after each row). Where
    batch 1 runs greedy first, every later greedy row also counts the requests equal to their prompt
    decoded alone (`equal_alone`: batch 1's autoregressive tokens)."""
    rows: list[dict] = []
    alone = None
    for batch in e2e.batch_sizes(args, device):
        groups = prompt_batches(prompts, batch)
        for temperature in args.temperatures:
            setting, ar_tokens = bench_setting(target, drafter, groups, batch, temperature, args, alone)
            if batch == 1 and temperature == 0:
                alone = ar_tokens
            for r in setting:
                rows.append(r)
                if on_row is not None:
                    on_row(rows, r)
    return rows


def costs(target, drafter, prompts: list[list[int]], args, device) -> list[dict]:
    """bench.forward_cost rows per batch size (CUDA): the decode step, a verify of each N run (DFlash's
    block, budget + 1 per DDTree budget) and the draft, on a prefix of the mean prompt length plus half
    the new tokens."""
    from kdtree_engine.bench.timing import device_copy_bandwidth

    prefix = round(sum(map(len, prompts)) / len(prompts)) + args.new_tokens // 2
    tokens = [drafter.block_size] + [b + 1 for b in args.budgets]
    args.copy_bw = getattr(args, "copy_bw", None) or device_copy_bandwidth(device)
    rows = []
    for batch in e2e.batch_sizes(args, device):
        rows += forward_cost.cost_rows(target, drafter, batch, tokens, prefix, args.impl, args.copy_bw)
    return rows


def _count_cell(r: dict, key: str) -> str:
    return "-" if r.get(key) is None else f"{r[key]}/{r['requests']}"


def markdown(rows: list[dict], header: str, experts: list[dict] | None = None, forwards=None) -> str:
    """The nano rows (equal to AR: requests whose greedy output is autoregressive decoding's at the
    same batch, token for token; same alone: requests whose greedy output is their prompt's
    autoregressive decoding at batch 1), their per-stage times, and the expert touch and forward cost
    tables when given."""
    from kdtree_engine.bench import experts as touch

    heads = ["batch", "temperature", "method", "budget", "tokens/s", "speedup", "tau", "fwd/token",
             "round ms", "equal to AR", "same alone"]  # fmt: skip
    body = [
        [r["batch"], f"{r['temperature']:g}", r["method"], r["budget"] or "-", r["tokens_per_s"],
         f"{r['speedup']:.2f}x", f"{r['tau']:.2f}", f"{r['forwards_per_token']:.3f}", f"{r['round_ms']:.2f}",
         _count_cell(r, "equal_to_ar"), _count_cell(r, "equal_alone")]
        for r in rows
    ]  # fmt: skip
    lead = ["batch", "temperature", "method", "budget"]
    stages = e2e.stage_table(
        rows, lead, lambda r: [r["batch"], f"{r['temperature']:g}", r["method"], r["budget"] or "-"]
    )
    parts = [header, markdown_table(heads, body), "Per-stage time per round:", stages]

    def setting(r: dict) -> list:
        return [r["batch"], f"{r['temperature']:g}"]

    auto = e2e.auto_table(rows, lead[:2], setting)
    if auto:
        parts += ['Budget "auto": the rounds per bucket, predicted and observed tokens per request:', auto]
    costs = e2e.round_cost_table(rows, [*lead[:2], "method", "budget"],
                                 lambda r: [*setting(r), r["method"], r["budget"] or "-"])  # fmt: skip
    if costs:
        parts += [e2e.ROUND_COSTS_TITLE, costs]
    if experts:
        parts.append(touch.markdown(experts))
    if forwards:
        parts.append(forward_cost.markdown(forwards, "the DFlash drafter"))
    return "\n\n".join(parts)


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over autoregressive decoding against the budget: one line per method, temperature and
    batch (DFlash is one point at its chain length)."""
    fixed = [r for r in rows if r["method"] != "autoregressive" and r["budget"] != "auto"]
    budgets = sorted({r["budget"] for r in fixed})
    series: dict[str, list] = {}
    for r in fixed:
        name = f"{r['method']} T={r['temperature']:g} batch {r['batch']}"
        series.setdefault(name, [None] * len(budgets))[budgets.index(r["budget"])] = r["speedup"]
    if not series:  # autoregressive rows only, so far
        return
    title = "bench e2e --target nano: speedup over autoregressive decoding"
    plot_series(path, title, [f"budget {b}" for b in budgets], series, ylabel="speedup", logy=False)


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


def _header(target, drafter, drafter_label: str, prompts, args, device, dtype) -> str:
    c = target.config
    params = sum(p.numel() for p in target.parameters())
    stamp = utc_stamp()
    lengths = [len(p) for p in prompts]
    return (
        f"bench e2e --target nano, {device_label(device)}, {stamp}, torch {torch.__version__}, "
        f"{str(dtype).removeprefix('torch.')}, kimi-nano ({c.num_hidden_layers} layers, {params / 1e6:.1f}M "
        f"parameters, trained), {drafter_label} (block size {drafter.block_size}); {len(prompts)} held-out "
        f"prompts ({min(lengths)}-{max(lengths)} tokens), {args.new_tokens} new tokens per request (EOS "
        f"ignored), seed {args.seed}" + (f"; {e2e.CAPTURE_NOTE}" if device.type == "cuda" else "")
    )


def main(args: argparse.Namespace, device: torch.device) -> int:
    from kdtree_engine.assets import KIMI_NANO
    from kdtree_engine.bench import experts
    from kdtree_engine.engine.tokenizer import load_tokenizer
    from kdtree_engine.model import load_model

    t0 = time.perf_counter()
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens: expected >= 1, got {args.new_tokens}")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    prompts = nano_prompts(args.prompts)
    e2e.batch_sizes(args, device)  # bad arguments fail before anything is loaded
    path = drafter_path(args.drafter)
    target = load_model(KIMI_NANO, dtype=dtype, device=device)
    drafter, drafter_label = nano_drafter(path, target, load_tokenizer(KIMI_NANO).token_id("<|mask|>"))
    header = _header(target, drafter, drafter_label, prompts, args, device, dtype)
    print(header, flush=True)

    def progress(rows, row):
        e2e.print_row(row)
        e2e.report(rows, header, args.out, target="nano")  # a cut run keeps what it measured

    rows = bench(target, drafter, prompts, args, device, on_row=progress)
    touches = experts.touch_rows(target, drafter, prompts, args.budgets, args.new_tokens, args.impl)
    forwards = costs(target, drafter, prompts, args, device) if device.type == "cuda" else None
    e2e.report(rows, header, args.out, target="nano", experts=touches, forwards=forwards)
    print(markdown(rows, header, touches, forwards))
    print(f"bench e2e --target nano: {time.perf_counter() - t0:.1f} s in all", flush=True)
    return 0
