"""`kdtree-engine bench sglang`: the SGLang DDTree port's tree path against our drop-in, same run.

Both sides are called as the port's worker calls them, with its buffers, on the same inputs per
(batch B, budget): bf16 draft logits [B * L, V] (the vocab matmul's output), target argmax tokens and
target probabilities [B, budget + 1, V]. Stages:
- topk: the worker's draft top-k on one rank (port: float32 copy, max, exp-sum, torch.topk; ours:
  integrations.sglang.topk.whole_vocab_topk, the fused kernel);
- build: build_ddtree_tree_gpu from the same top-k (the port's: its Triton heap);
- compile: compile_ddtree_tree for an attention backend that reads `visibility` (no packed mask);
- follow: follow_verified_tree_gpu from the target's argmax tokens (greedy verify);
- sample: sample_ddtree_target_probs_gpu from the target's probabilities (sampled verify);
- greedy path: topk + build + compile + follow, each side on its own outputs (one call chain).
Times: calls as the worker makes them (host launch costs included), so the host timer of the one
harness (bench/timing.time_host): the wall clock of `--iters` back-to-back calls, the GPU synchronized
before and after, median of `--reps` (docs/results.md says how older tables were timed); ratios port /
ours, same run.
Our build, compile, follow and sample replay a CUDA graph once a call repeats on the same buffers
(integrations/sglang/replay.py), as they do inside SGLang; "without replay" times our greedy path with
every call eager (KDTREE_ENGINE_SGLANG_GRAPHS=0). "same trees": requests whose tree (tokens and
parents) the port builds equal to ours from the same top-k (it is not exact on ties; ours equals the
official builder, as the tests check). "saved/round" is what one decoding round of the greedy path
saves at this batch, budget and vocabulary (per tensor-parallel rank).

The verify-attention section (bench/sglang_verify.py; `--sections`) times the attention of the DDTree
target verify that follows: our kdtree_mla backend against SGLang's Triton extend kernel with the
port's dense custom mask (loaded from the checkout's attention files, bench/sglang_extend.py), at Kimi
shapes per GPU, with its saving per round next to the drop-in's at budget t - 1 (from this run's tree
path rows, or from an earlier run's json with --drop-in-json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from kdtree_engine.bench.peers import load_sglang_port, port_tree_buffers
from kdtree_engine.bench.plot import markdown_table, plot_series, utc_stamp
from kdtree_engine.bench.sglang_verify import VerifyGrid
from kdtree_engine.bench.timing import time_host

STAGES = ("topk", "build", "compile", "follow", "sample", "greedy path")
TREE, VERIFY = "tree", "verify-attention"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", default=".peers/sglang", help="checkout of the SGLang DDTree port")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32, 64], help="batch sizes B")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--depth", type=int, default=15, help="draft block length L (Kimi DFlash: 15)")
    parser.add_argument("--vocab", type=int, default=163840, help="vocabulary size V (Kimi-K2: 163840)")
    parser.add_argument("--iters", type=int, default=10, help="back-to-back calls per timed run")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--no-sample", action="store_true", help="skip the sampled verify stage")
    parser.add_argument("--out", default="out/bench_sglang", help="directory for the table, plot and json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", nargs="+", choices=[TREE, VERIFY], default=[TREE, VERIFY],
                        help="tree: the tree path (draft logits to accepted tokens); verify-attention: the "
                        "target verify's attention, ours vs SGLang's Triton extend kernel")  # fmt: skip
    grid = VerifyGrid()
    ints = {"type": int, "nargs": "+"}
    parser.add_argument("--verify-heads", **ints, default=list(grid.heads), help="heads per GPU")
    parser.add_argument("--verify-tokens", **ints, default=list(grid.tokens), help="tree nodes t")
    parser.add_argument("--verify-prefixes", **ints, default=list(grid.prefixes), help="prefix per request")
    parser.add_argument("--verify-batch", **ints, default=list(grid.batch), help="batch sizes")
    pages_help = "KV pool page sizes (1: SGLang's token pool; 64: its FlashMLA pages)"
    parser.add_argument("--verify-page-sizes", **ints, default=list(grid.pages), help=pages_help)
    layers_help = "attention layers per round (Kimi-K2: 61)"
    parser.add_argument("--layers", type=int, default=grid.layers, help=layers_help)
    parser.add_argument("--verify-rep-ms", type=float, default=grid.rep_ms, help="do_bench ms per timing")
    parser.add_argument("--verify-max-gb", type=float, default=grid.max_gb, help="skip points needing more")
    parser.add_argument("--drop-in-json", help="an earlier run's sglang_bench.json whose tree path rows give "
                        "the drop-in's saving per round when this run does not measure it")  # fmt: skip


def eager_us(fn, iters: int, reps: int) -> float:
    """Median wall-clock microseconds per call of fn over `reps` runs of `iters` back-to-back calls, the
    GPU synchronized around each run (bench/timing.time_host; one untimed run first)."""
    return time_host(fn, calls=iters, reps=reps, sync="cuda").median_us


class Side:
    """One implementation's tree path (`fns`: the port's ddtree_utils or our integrations.sglang) with
    the port worker's buffers for (B, budget)."""

    def __init__(self, fns, topk, b: int, budget: int, device: torch.device):
        self.fns, self.topk_fn, self.b, self.budget = fns, topk, b, budget
        n, i64 = budget + 1, dict(dtype=torch.int64, device=device)
        self.tree = port_tree_buffers(b, budget, device)
        self.ids_buf, self.pos_buf = torch.empty(b * n, **i64), torch.empty(b * n, **i64)
        self.follow_bufs = dict(
            accepted_indices=torch.empty(b, n, **i64),
            accepted_token_ids=torch.empty(b, n, **i64),
            accepted_lens=torch.empty(b, **i64),
            next_tokens=torch.empty(b, **i64),
        )
        self.sample_bufs = dict(
            uniform_samples=torch.empty(b, n, dtype=torch.float32, device=device),
            uniform_final=torch.empty(b, dtype=torch.float32, device=device),
            reject_indices=torch.empty(b, **i64),
            reject_child_tokens=torch.empty(b, n, **i64),
            reject_child_counts=torch.empty(b, **i64),
            **{k: torch.empty_like(v) for k, v in self.follow_bufs.items()},
        )
        self.lp = self.ids = self.built = self.verify = None

    def topk(self, logits: torch.Tensor) -> None:
        lp, ids = self.topk_fn(logits, min(self.budget, logits.shape[-1]))
        self.lp, self.ids = lp.view(self.b, -1, lp.shape[-1]), ids.view(self.b, -1, ids.shape[-1])

    def build(self, lp=None, ids=None) -> None:
        self.built = self.fns.build_ddtree_tree_gpu(
            draft_top_log_probs=self.lp if lp is None else lp,
            draft_top_token_ids=self.ids if ids is None else ids,
            tree_budget=self.budget,
            device=self.ids_buf.device,
            **self.tree,
        )

    def compile(self, roots: torch.Tensor, starts: torch.Tensor) -> None:
        tokens, depths, _, _, vis, sizes, sizes_cpu = self.built
        self.verify = self.fns.compile_ddtree_tree(
            roots,
            tokens,
            depths,
            vis,
            starts,
            starts,
            self.budget,
            sizes,
            roots.device,
            past_lens_cpu=None,
            actual_sizes_cpu=sizes_cpu,
            build_attention_mask=False,
            _out_verify_input_ids=self.ids_buf,
            _out_verify_position_ids=self.pos_buf,
        )

    def follow(self, target_predict: torch.Tensor):
        return self.fns.follow_verified_tree_gpu(
            draft_tokens=self.verify[0],
            target_predict=target_predict,
            parents=self.built[2],
            actual_tree_sizes=self.built[5],
            **self.follow_bufs,
        )

    def sample(self, probs: torch.Tensor):
        return self.fns.sample_ddtree_target_probs_gpu(
            target_probs=probs,
            draft_tokens=self.verify[0],
            parents=self.built[2],
            actual_tree_sizes=self.built[5],
            **self.sample_bufs,
        )

    def greedy_path(self, logits, roots, starts, target_predict):
        self.topk(logits)
        self.build()
        self.compile(roots, starts)
        return self.follow(target_predict)


@contextlib.contextmanager
def graphs_off():
    """Our calls without the graph replay (integrations/sglang/replay.py): every call eager."""
    from kdtree_engine.integrations.sglang import replay

    saved = os.environ.get(replay.ENV)
    os.environ[replay.ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[replay.ENV]
        else:
            os.environ[replay.ENV] = saved


def same_trees(port: Side, ours: Side) -> int:
    """Requests whose tree (tokens, parents) the port built equal to ours from the same top-k."""
    ours.build(port.lp, port.ids)
    port.build()
    same = (port.built[0] == ours.built[0]).all(-1) & (port.built[2] == ours.built[2]).all(-1)
    return int(same.sum())


def bench_config(port: Side, ours: Side, inputs: dict, args) -> dict:
    logits, roots, starts, target, probs = (
        inputs[k] for k in ("logits", "roots", "starts", "target", "probs")
    )

    def timed(fn) -> float:
        return eager_us(fn, args.iters, args.reps)

    row = {"batch": port.b, "budget": port.budget}
    for name, side in (("port", port), ("ours", ours)):
        side.greedy_path(logits, roots, starts, target)
        row[f"{name} topk"] = timed(lambda s=side: s.topk(logits))
        row[f"{name} build"] = timed(lambda s=side: s.build(port.lp, port.ids))
        row[f"{name} compile"] = timed(lambda s=side: s.compile(roots, starts))
        row[f"{name} follow"] = timed(lambda s=side: s.follow(target))
        if probs is not None:
            row[f"{name} sample"] = timed(lambda s=side: s.sample(probs))
        row[f"{name} greedy path"] = timed(lambda s=side: s.greedy_path(logits, roots, starts, target))
    row["same trees"] = same_trees(port, ours)
    with graphs_off():
        row["ours eager greedy path"] = timed(lambda: ours.greedy_path(logits, roots, starts, target))
    return row


def make_inputs(b: int, budget: int, args, device, gen: torch.Generator) -> dict:
    n = budget + 1
    logits = (torch.randn(b * args.depth, args.vocab, generator=gen, device=device) * 2).bfloat16()
    target = torch.randint(0, args.vocab, (b, n), generator=gen, device=device)
    probs = None
    if not args.no_sample:
        probs = torch.softmax(torch.randn(b, n, args.vocab, generator=gen, device=device) * 2, dim=-1)
    starts = torch.randint(100, 4000, (b,), generator=gen, device=device)
    roots = torch.randint(0, args.vocab, (b,), generator=gen, device=device)
    return dict(logits=logits, roots=roots, starts=starts, target=target, probs=probs)


def report(rows: list[dict], header: str, out: Path) -> str:
    stages = [s for s in STAGES if f"port {s}" in rows[0]]
    heads = ["B", "budget"] + [f"{s} port / ours us (x)" for s in stages]
    heads += ["greedy path ours without replay us (x)", "saved/round us", "same trees"]
    table = []
    for r in rows:
        cells = [r["batch"], r["budget"]]
        for s in stages:
            p, o = r[f"port {s}"], r[f"ours {s}"]
            cells.append(f"{p:.1f} / {o:.1f} ({p / o:.1f}x)")
        eager = r["ours eager greedy path"]
        cells += [f"{eager:.1f} ({r['port greedy path'] / eager:.1f}x)"]
        cells += [r["port greedy path"] - r["ours greedy path"], f"{r['same trees']}/{r['batch']}"]
        table.append(cells)
    text = header + "\n\n" + markdown_table(heads, table) + "\n"
    labels = [f"B{r['batch']} n{r['budget']}" for r in rows]
    series = {f"{s} (port / ours)": [r[f"port {s}"] / r[f"ours {s}"] for r in rows] for s in stages}
    title = "SGLang DDTree port / kdtree-engine drop-in (speedup)"
    if plot_series(out / "sglang_bench.png", title, labels, series, ylabel="port time / our time"):
        text += "\n![speedups](sglang_bench.png)\n"
    return text


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("device: bench sglang runs the port's Triton kernels, which need a CUDA GPU")
    port = load_sglang_port(args.port)
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (
        f"SGLang DDTree port vs kdtree-engine drop-in, L={args.depth}, V={args.vocab}, bf16 draft logits: "
        f"{torch.cuda.get_device_name(device)}, {utc_stamp()}\n\n"
        f"command: kdtree-engine bench sglang {' '.join(sys.argv[3:])}".rstrip()
    )
    extend, grid = load_verify_peer(args), verify_grid(args)  # checked before the tree path runs
    earlier = drop_in_rows(args.drop_in_json)
    results = {"header": header, "rows": [], "verify_attention": []}
    if TREE in args.sections:
        for row in tree_rows(port, args, device):
            results["rows"].append(row)
            write_results(results, out, earlier)  # after every row: a run cut short keeps what it measured
    if extend is not None:
        from kdtree_engine.bench.sglang_verify import run_section

        def on_row(row: dict) -> None:
            print(json.dumps(row), flush=True)
            results["verify_attention"].append(row)
            write_results(results, out, earlier)

        run_section(
            extend, port.kernels.compile_ddtree_tree_triton, grid, device, on_row, verify_flashmla(grid)
        )
    print(write_results(results, out, earlier))
    return 0


def verify_flashmla(grid: VerifyGrid):
    """The flash_mla module for the verify section's cascade column when the grid has 64-slot pages and
    FlashMLA is importable (never a dependency); None otherwise, with a printed reason."""
    from kdtree_engine.bench import flashmla

    if flashmla.PAGE not in grid.pages:
        return None
    module = flashmla.load()
    if module is None:
        print("verify attention: flash_mla is not importable; no FlashMLA cascade column", flush=True)
    return module


def verify_grid(args: argparse.Namespace) -> VerifyGrid:
    """The verify-attention section's points from the --verify-* arguments."""
    return VerifyGrid(
        heads=tuple(args.verify_heads),
        tokens=tuple(args.verify_tokens),
        prefixes=tuple(args.verify_prefixes),
        batch=tuple(args.verify_batch),
        pages=tuple(args.verify_page_sizes),
        layers=args.layers,
        rep_ms=args.verify_rep_ms,
        max_gb=args.verify_max_gb,
    )


def load_verify_peer(args):
    """extend_attention_fwd from the checkout when the verify-attention section is asked for; None (with a
    printed reason) where the checkout lacks its files and the tree path still runs; ValueError naming
    `path` where the section was the only one asked for."""
    if VERIFY not in args.sections:
        return None
    from kdtree_engine.bench.sglang_extend import load_extend_attention

    try:
        return load_extend_attention(args.port)
    except ValueError as exc:
        if TREE not in args.sections:
            raise
        print(f"verify attention: skipped: {exc}", flush=True)
        return None


def tree_rows(port, args, device):
    """The tree path's rows, one per (batch, budget), as each is measured."""
    from kdtree_engine.integrations import sglang as ours_fns
    from kdtree_engine.integrations.sglang.topk import whole_vocab_topk

    gen = torch.Generator(device=device).manual_seed(args.seed)
    for b in args.batch:
        for budget in args.budgets:
            inputs = make_inputs(b, budget, args, device, gen)
            sides = (
                Side(port.utils, port.topk, b, budget, device),
                Side(ours_fns, whole_vocab_topk, b, budget, device),
            )
            row = bench_config(*sides, inputs, args)
            print(json.dumps(row), flush=True)
            del inputs, sides
            torch.cuda.empty_cache()
            yield row


def drop_in_rows(path: str | None) -> list[dict]:
    """The tree path rows of an earlier run's sglang_bench.json (--drop-in-json), or []."""
    if not path:
        return []
    rows = json.loads(Path(path).read_text()).get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"drop-in-json: {path} has no tree path rows (a sglang_bench.json is expected)")
    return rows


def write_results(results: dict, out: Path, earlier: list[dict] = ()) -> str:
    """sglang_bench.md (the tree path's table and plot, then the verify attention's, with the drop-in's
    saving per round from this run's tree path rows, else from `earlier`'s) and .json; returns the
    markdown."""
    from kdtree_engine.bench.sglang_verify import report as verify_report

    text = results["header"] + "\n"
    if results["rows"]:
        text = report(results["rows"], results["header"], out)
    if results["verify_attention"]:
        text += "\n" + verify_report(results["verify_attention"], results["rows"] or list(earlier))
    (out / "sglang_bench.md").write_text(text)
    (out / "sglang_bench.json").write_text(json.dumps(results, indent=1))
    return text
