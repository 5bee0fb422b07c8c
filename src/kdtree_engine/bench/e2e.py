"""`kdtree-engine bench e2e`: whole generation runs, autoregressive against DFlash and DDTree, on one
of two targets (`--target`): `small` (bench/e2e_small.py: a scaled-down Kimi-K2 shape with random bf16
weights and a stand-in drafter, CUDA only) or `nano` (bench/e2e_nano.py: the shipped trained kimi-nano
and its DFlash drafter, CPU or GPU). Each module's docstring says what it reports.

Tokens/s is the wall clock of whole generate() calls (prefill included, the one-time CUDA graph capture
excluded: a server captures at start-up; it is reported apart): end to end by definition. Every timed
generate() call follows an identical untimed one (kernel compilation, caches warm). On CUDA both targets
also report, per batch size, what one forward and one draft cost (bench/forward_cost.py: kernels per
forward, decode and verify time against their memory rooflines, the draft against a decode step), timed
with the one harness of every benchmark (bench/timing.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table

CAPTURE_NOTE = "tokens/s excludes the one-time graph capture (column capture_s)"
TARGETS = ("small", "nano")
STAGE_KEYS = ("draft", "tree_build", "compile", "verify", "accept", "commit")


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
    parser.add_argument(
        "--auto",
        action="store_true",
        help='add a DDTree row with budget "auto" (each round picks its budget; table of its choices)',
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (small)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12, help="target layers (small; the shape's 12)")
    parser.add_argument("--impl", choices=("triton", "hopper"), default=None)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--row-invariant",
        action="store_true",
        help="every run with the target's row-invariant mode (greedy outputs then equal autoregressive "
        "decoding bit for bit; issue 32)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/e2e"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    drafter = "nano: a DFlash drafter dir, or 'random' (untrained); default: assets/kimi-nano-dflash"
    parser.add_argument("--drafter", default=None, help=drafter)
    parser.add_argument("--prompts", type=int, default=8, help="nano: held-out prompts to run")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every sampled run")


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


TIMED_CALLS = 5  # untimed calls per setting; the one of median wall time gives tokens/s


@dataclass
class Warmed:
    """An engine.Runner of these prompts' shape after the bench's two warm-up calls of the same prompts:
    one that compiles the kernels and captures the rounds, one that times each stage (`staged`, whose
    stage times go on the result's stats)."""

    runner: object
    prompts: list[list[int]]
    staged: object  # the stage-timed call's GenerationOutput


def warmed(target, drafter, prompts, config) -> Warmed:
    """A Runner for `config` on these prompts, warmed (Warmed)."""
    from kdtree_engine.engine import Runner

    runner = Runner(target, drafter, config, batch_size=len(prompts), prompt_len=max(len(p) for p in prompts))
    runner.generate(prompts)
    return Warmed(runner, prompts, runner.generate(prompts, stage_timing=True))


def alternate(runs: list[Warmed], calls: int = TIMED_CALLS) -> list:
    """Per warmed Runner, the generate() call of median wall time (less capture) among `calls` calls
    without stage timers (GenerationOutput, with its warm-up's stage times), the Runners' calls taken in
    turn (the first call of each, then the second of each, ...), so that every row of a comparison runs
    under the same state of the device (clocks, temperature) and a drift over the run does not land on
    the rows run last. The timed calls replay the captured rounds from their first round (its first draft
    eager), as a serving engine that captured its graphs at startup; the prefill is in their time.
    Timing every stage records two events per stage and reads them back each round, which slows the
    pipelined rounds (engine.loop), so tokens/s come from the untimed calls; the median of several keeps
    one slow call (a prefill or host hiccup) from deciding a setting's figure (docs/engine.md,
    "Benchmark")."""
    medians = [_median_call(calls_of_run) for calls_of_run in alternate_calls(runs, calls)]
    for run, out in zip(runs, medians):
        out.stats.stage_times = run.staged.stats.stage_times
    return medians


def alternate_calls(runs: list[Warmed], calls: int) -> list[list]:
    """Per warmed Runner, its `calls` calls without stage timers (GenerationOutput), taken in turn: the
    first call of each Runner, then the second of each, and so on."""
    outs: list[list] = [[] for _ in runs]
    for _ in range(calls):
        for run, calls_of_run in zip(runs, outs):
            calls_of_run.append(run.runner.generate(run.prompts, stage_timing=False))
    return outs


def _median_call(outs: list):
    """The call of median wall time, capture excluded."""
    return sorted(outs, key=lambda o: o.stats.wall_time - o.stats.capture_time)[len(outs) // 2]


def timed_runs(target, specs: list[tuple[object, object]], prompts, calls: int = TIMED_CALLS) -> list:
    """alternate() over one warmed Runner per (drafter, config) of `specs`, all on these prompts: the
    rows of one comparison, timed in turn (GenerationOutput per spec, in order)."""
    return alternate([warmed(target, drafter, prompts, config) for drafter, config in specs], calls)


def summarize(outputs) -> dict:
    """The measures of timed generate() calls taken together: tokens/s over their summed wall time less
    graph capture, target forwards per token, tau over every (request, round), time per round of each
    stage; `tokens`: the outputs' token lists, concatenated; `call_log`: per call, in order, its new
    tokens, ms (less capture), rounds and its text's digest (a batch's calls are its prompt groups: every
    row runs the same groups, so a row's call i compares with another's, and on the same text where the
    digests agree)."""
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
        "eager_rounds": sum(s.eager_rounds for s in stats),
        "budgets": dict(sorted(sum((Counter(s.budget_histogram) for s in stats), Counter()).items())),
        "budget_report": _merged_report([s.budget_report for s in stats if s.budget_report]),
        "call_s": wall,
        "round_costs": _cost_accounting([t for s in stats for t in s.round_seconds]),
        "round_log": _round_log(stats),
        "call_log": [
            [
                o.stats.total_new_tokens,
                round((o.stats.wall_time - o.stats.capture_time) * 1e3, 4),
                o.stats.rounds,
                text_digest(o.tokens),
            ]
            for o in outputs
        ],  # fmt: skip
    }


def text_digest(tokens: list[list[int]]) -> str:
    """A short digest of a call's new tokens, request by request: equal digests, equal texts (two rows
    whose greedy bf16 outputs part decode texts that accept differently, docs/engine.md)."""
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]


def _round_log(stats) -> list[list] | None:
    """Budget "auto": each timed call's rounds in order, [bucket, measured ms or None, why, expected,
    rate, costs] (the policy's choices against what each cost; why: which part of the policy picked
    it, engine.budget.PICK_REASONS; expected: the batch's expected tokens at every bucket, in the order
    of the auto buckets, or None in a call given to steps; rate: the steady rate in tokens per ms and
    costs: the ms per round of every bucket that the per-round rule weighed, None where it did not
    decide); None for a fixed budget."""
    if not any(s.budgets for s in stats):
        return None
    return [[_logged_round(k, t, *pick) for k, t, pick in zip(s.budgets, s.round_seconds, s.budget_picks)]
            for s in stats]  # fmt: skip


def _logged_round(bucket: int, seconds: float, why: str, expected: list[float] | None,
                  rate: float | None = None, costs: list[float] | None = None) -> list:  # fmt: skip
    """One round of the log: [bucket, ms (None: not measured), why, the batch's E per bucket or None,
    the rule's steady rate in tokens per ms and its ms per bucket, or None]."""
    ms = None if seconds != seconds else round(seconds * 1e3, 4)
    return [bucket, ms, why, None if expected is None else [round(x, 2) for x in expected],
            None if rate is None else round(rate * 1e-3, 3),
            None if costs is None else [round(c * 1e3, 4) for c in costs]]  # fmt: skip


def _cost_accounting(seconds: list[float]) -> dict | None:
    """How much of the calls' time their rounds' measured costs (engine.loop: the host clock between
    two reads on CUDA) account for: rounds read, rounds measured (not: a call's first round, and on CUDA
    a read whose interval held a capture or an eager round), and the measured seconds summed; None
    without rounds."""
    if not seconds:
        return None
    measured = [t for t in seconds if t == t]
    return {"rounds": len(seconds), "measured": len(measured), "seconds": sum(measured)}


def _merged_report(reports: list[dict]) -> dict:
    """The auto budget's per-bucket reports of several calls, weighted by their rounds."""
    merged: dict = {}
    for report in reports:
        for k, r in report.items():
            m = merged.setdefault(k, {"rounds": 0, "predicted": 0.0, "expected": 0.0, "observed": 0.0,
                                      "seconds": []})  # fmt: skip
            n = r["rounds"]
            m["rounds"] += n
            for key in ("predicted", "expected", "observed"):
                m[key] += n * r[key] if n and r[key] == r[key] else 0.0
            m["seconds"].append(r["seconds"])  # a bucket's cost is known without rounds in this call
    for m in merged.values():
        n = m["rounds"]
        for key in ("predicted", "expected", "observed"):
            m[key] = m[key] / n if n else float("nan")
        times = [t for t in m["seconds"] if t == t]
        m["seconds"] = sorted(times)[len(times) // 2] if times else float("nan")
    return merged


def auto_table(rows: list[dict], lead_heads: list[str], lead) -> str | None:
    """The auto rows' choices: per bucket, rounds, mean tokens per request predicted (1 + S of the
    round's own draft), expected by the choice (engine.budget's estimator) and observed, the median
    round cost the policy held (also for a bucket it did not pick in these calls), and which part of
    the policy picked its rounds in the timed calls (the round log's reasons, counted); None without an
    auto row."""
    body = []
    for r in rows:
        for k, b in (r.get("budget_report") or {}).items():
            if not b["rounds"] and b["seconds"] != b["seconds"]:
                continue
            means = [f"{b[key]:.2f}" if b["rounds"] else "-" for key in ("predicted", "expected", "observed")]
            body.append([*lead(r), k, b["rounds"], *means, f"{b['seconds'] * 1e3:.3f}",
                         _picked_by(r.get("round_log"), int(k))])  # fmt: skip
    if not body:
        return None
    heads = [*lead_heads, "bucket", "rounds", "predicted", "expected", "observed", "round ms", "picked by"]
    return markdown_table(heads, body)


def _picked_by(log: list[list] | None, bucket: int) -> str:
    """How many of the logged rounds of `bucket` each part of the policy picked ("rule 80 call 3"), or
    "-" where none was logged."""
    whys = Counter(entry[2] for call in log or [] for entry in call if entry[0] == bucket)
    return " ".join(f"{why} {n}" for why, n in sorted(whys.items())) or "-"


ROUND_COSTS_TITLE = "Each row's measured rounds against its calls' time (rest: prefill, first round, end):"


def round_cost_table(rows: list[dict], lead_heads: list[str], lead) -> str | None:
    """Every row's time as its rounds measured it against the calls' wall time (less capture): rounds
    read, rounds measured, the measured rounds' summed cost, the calls' time, what of it they account
    for, and the rest (prefill, a call's first round, its end). For the auto budget a policy whose costs
    explain the wall time prices buckets right; against a fixed budget's rest, what auto adds outside
    its rounds. None without measured rounds."""
    body = []
    for r in rows:
        costs = r.get("round_costs")
        if costs and r["call_s"]:
            share = costs["seconds"] / r["call_s"]
            rest = (r["call_s"] - costs["seconds"]) * 1e3
            body.append([*lead(r), costs["rounds"], costs["measured"], f"{costs['seconds'] * 1e3:.2f}",
                         f"{r['call_s'] * 1e3:.2f}", f"{share:.2f}", f"{rest:.2f}"])  # fmt: skip
    if not body:
        return None
    heads = [*lead_heads, "rounds", "measured", "measured ms", "call ms", "measured / call", "rest ms"]
    return markdown_table(heads, body)


def print_row(r: dict) -> None:
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)


def stage_table(rows: list[dict], lead_heads: list[str], lead) -> str:
    """Per-stage ms per round, after the leading cells lead(row)."""
    heads = lead_heads + [f"{k} ms" for k in STAGE_KEYS]
    body = [list(lead(r)) + [f"{r['stages_ms'].get(k, 0.0):.3f}" for k in STAGE_KEYS] for r in rows]
    return markdown_table(heads, body)


def report(
    rows: list[dict], header: str, out: Path, *, target: str = "small", experts=None, forwards=None
) -> None:
    """Under `out`: e2e.json, e2e.md and e2e.png (small: tokens/s per batch size and method), or
    e2e_nano.json (rows, and the expert touch rows when given), e2e_nano.md and e2e_nano.png (nano:
    speedup against the budget); `forwards` (bench.forward_cost rows) go into both files when given."""
    from kdtree_engine.bench import e2e_nano, e2e_small

    out.mkdir(parents=True, exist_ok=True)
    stem = "e2e" if target == "small" else "e2e_nano"
    payload = {"header": header, "rows": rows}
    if experts is not None:
        payload["experts"] = experts
    if forwards is not None:
        payload["forwards"] = forwards
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    if target == "small":
        (out / f"{stem}.md").write_text(e2e_small.markdown(rows, header, forwards))
        e2e_small.plot(rows, out / f"{stem}.png")
    else:
        (out / f"{stem}.md").write_text(e2e_nano.markdown(rows, header, experts, forwards))
        e2e_nano.plot(rows, out / f"{stem}.png")


def main(args: argparse.Namespace) -> int:
    from kdtree_engine.bench import e2e_nano, e2e_small

    device = resolve_device(args.device)
    return e2e_small.main(args, device) if args.target == "small" else e2e_nano.main(args, device)
