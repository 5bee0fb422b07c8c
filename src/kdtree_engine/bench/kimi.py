"""`kdtree-engine bench kimi`: one GPU's share of Kimi-K2 under 8-way parallelism, measured, and the
decoding round of the whole model projected from it (issue 34).

Sections (`--sections`), each timed on the GPU with the one harness (bench/timing.time_graph: CUDA
graph replays, the L2 flushed before each, medians) unless said otherwise, on random bf16 weights:
- layer: the attention share (input norm + MLA with 8 of the 64 heads on a latent cache of `prefix`
  rows per request; n new tokens per request on a random tree's visibility; bench/kimi_layer.py), its
  attention plan (once per forward), the MoE share (norm, router, the busiest rank's 48 of 384
  experts under the routing given, the shared expert's slice; bench/kimi_routing.py) and the rank's
  lm_head rows; each with the bytes it must move and its memory roofline (bytes / the copy bandwidth
  measured in the same run);
- drafter: one drafting round of the Kimi-K2.5 DFlash drafter's share with 1 and 2 layers; the
  difference is one layer, the rest (fc, embedding, lm_head rows, norms) the fixed part; and the
  drafter's attention alone, its context in the splits chosen against one split (kernels/
  drafter_attention.py);
- tree: our whole greedy tree path (draft top-k over the full vocabulary, build, compile, follow) as
  SGLang's worker calls it through our drop-in, host-timed as bench sglang times it (bench/sglang.py);
- port (needs the port's checkout, scripts/fetch_peers.sh): the SGLang DDTree port's tree path the same
  way, and the verify attention at 8 heads against SGLang's Triton extend kernel with its dense mask
  (bench/sglang_verify.time_point).
Then bench/kimi_projection.py adds them up into tokens per second per request for the whole model.
`--from FILE` re-projects an earlier run's kimi_bench.json (other collective costs, say) without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from kdtree_engine.bench import kimi_projection as projection
from kdtree_engine.bench import kimi_routing as routing
from kdtree_engine.bench.kimi_layer import Shard
from kdtree_engine.bench.plot import markdown_table, utc_stamp

SECTIONS = ("layer", "drafter", "tree", "port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ints = {"type": int, "nargs": "+"}
    parser.add_argument("--batch", **ints, default=[1, 4, 16, 64], help="requests per GPU")
    parser.add_argument(
        "--tokens",
        **ints,
        default=[1, 2, 4, 8, 9, 17, 33, 65],
        help="tokens per request in one target forward (1: decode; 8: a DFlash chain of block "
        "8; budget + 1: a DDTree verify)",
    )
    parser.add_argument("--prefixes", **ints, default=[1024, 8192, 32768], help="cached tokens per request")
    parser.add_argument("--routings", nargs="+", choices=routing.ROUTINGS, default=list(routing.ROUTINGS))
    parser.add_argument("--budgets", **ints, default=list(projection.BUDGETS), help="DDTree budgets")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (attention heads cut)")
    parser.add_argument("--ep", type=int, default=8, help="expert-parallel ranks (routed experts cut)")
    parser.add_argument("--rep-ms", type=float, default=50.0, help="do_bench milliseconds per timing")
    parser.add_argument("--iters", type=int, default=10, help="tree path: back-to-back calls per timed run")
    parser.add_argument("--reps", type=int, default=5, help="tree path: timed runs (median)")
    parser.add_argument(
        "--port", default=".peers/sglang", help="checkout of the SGLang DDTree port (port section)"
    )
    parser.add_argument(
        "--allreduce-us",
        type=float,
        default=projection.Collectives.latency_us,
        help="collective latency of the projection (published figure: docs/kimi-scale.md)",
    )
    parser.add_argument(
        "--bus-gbps",
        type=float,
        default=projection.Collectives.bus_gbps,
        help="collective bus bandwidth of the projection, GB/s",
    )
    parser.add_argument(
        "--from", dest="from_json", type=Path, help="re-project this kimi_bench.json (no GPU)"
    )
    parser.add_argument(
        "--into",
        type=Path,
        help="add this run's sections to an earlier run's kimi_bench.json (one device call each)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("out/bench_kimi"), help="directory for the json and tables"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--row-invariant",
        action="store_true",
        help="the layer section in the row-invariant mode (issue 32): run once with and once without it "
        "for its cost at Kimi's shapes",
    )


def _check(args: argparse.Namespace) -> None:
    for name in ("batch", "tokens", "prefixes", "budgets"):
        values = getattr(args, name)
        if any(v < 1 for v in values):
            raise ValueError(f"{name}: expected integers >= 1, got {values}")
    if 1 not in args.tokens:
        raise ValueError(f"tokens: must include 1 (the decode step), got {args.tokens}")
    for name in ("rep_ms", "bus_gbps"):
        if not getattr(args, name) > 0:
            raise ValueError(f"{name.replace('_', '-')}: expected a number > 0, got {getattr(args, name)}")
    for name in ("from_json", "into"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            raise ValueError(f"{name.replace('_json', '')}: no file {path}")
    if args.allreduce_us < 0:
        raise ValueError(f"allreduce-us: expected a number >= 0, got {args.allreduce_us}")
    Shard(tp=args.tp, ep=args.ep)  # ValueError naming tp or ep


def points(args: argparse.Namespace, results: dict) -> list[projection.Point]:
    """The projection's points: every routing, prefix and batch of the run."""
    grid = results.get("grid", {})
    return [
        projection.Point(b, p, r)
        for r in grid.get("routings", args.routings)
        for p in grid.get("prefixes", args.prefixes)
        for b in grid.get("batch", args.batch)
    ]


def write(results: dict, args: argparse.Namespace) -> str:
    """kimi_bench.json (every row) and kimi_bench.md (the measured tables and the projection)."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kimi_bench.json").write_text(json.dumps(results, indent=1))
    grid = results.get("grid", {})
    comm = projection.Collectives(args.allreduce_us, args.bus_gbps, grid.get("tp", args.tp))
    counts = projection.ModelCounts(**grid.get("counts", {}))
    report = projection.report(
        results, points(args, results), grid.get("budgets", args.budgets), counts, comm
    )
    text = "\n\n".join(
        [results["header"], measured_tables(results), "## Projected round, whole model", report]
    )
    (args.out / "kimi_bench.md").write_text(text)
    return text


def counts_of(shard: Shard) -> projection.ModelCounts:
    """The projection's counts for the model and drafter the shard cuts."""
    c, d = shard.model, shard.drafter
    return projection.ModelCounts(c.num_hidden_layers, d.layers, c.hidden_size, c.vocab_size, d.block)


def _us(row: dict, key: str = "us") -> str:
    return f"{row[key]:.1f}" if key in row else "-"


def measured_tables(results: dict) -> str:
    """The layer, drafter and tree rows as markdown tables."""
    parts = []
    att = [
        [
            r["prefix"],
            r["batch"],
            r["tokens"],
            r["kernel"],
            _us(r),
            _us(r, "roofline_us"),
            f"{r['over_roofline']:.2f}x",
        ]
        for r in results.get("attention", [])
    ]
    if att:
        heads = ["prefix", "batch", "tokens", "kernel", "us", "roofline us", "time / roofline"]
        parts.append("Attention share (norm + MLA, 8 heads):\n\n" + markdown_table(heads, att))
    moe = [
        [
            r["routing"],
            r["batch"],
            r["tokens"],
            r["experts_request"],
            r["rank"],
            r["experts_rank"],
            r["assignments"],
            _us(r),
            _us(r, "roofline_us"),
            f"{r['over_roofline']:.2f}x",
        ]
        for r in results.get("moe", [])
    ]
    if moe:
        heads = [
            "routing",
            "batch",
            "tokens",
            "experts / request",
            "rank timed",
            "its experts touched",
            "its assignments",
            "us",
            "roofline us",
            "time / roofline",
        ]
        parts.append(
            "MoE share (norm, router, 48 routed experts, shared slice):\n\n" + markdown_table(heads, moe)
        )
    small = [
        (name, section)
        for name, section in [("plan", "plan"), ("lm_head rows", "lm_head")]
        if results.get(section)
    ]
    for name, section in small:
        rows = [[r["batch"], r["tokens"], r.get("prefix", "-"), _us(r)] for r in results[section]]
        parts.append(f"{name}:\n\n" + markdown_table(["batch", "tokens", "prefix", "us"], rows))
    drafter = [
        [
            r["prefix"],
            r["batch"],
            _us(r, "one_layer_us"),
            _us(r, "two_layer_us"),
            _us(r, "layer_us"),
            _us(r, "fixed_us"),
        ]
        for r in results.get("drafter", [])
    ]
    if drafter:
        heads = ["prefix", "batch", "1 layer us", "2 layers us", "per layer us", "fixed us"]
        parts.append("Drafter share, one round:\n\n" + markdown_table(heads, drafter))
    split = [
        [
            r["prefix"],
            r["batch"],
            r["splits"],
            _us(r),
            _us(r, "one_split_us"),
            _us(r, "roofline_us"),
            f"{r['max_diff']:.2g}",
        ]
        for r in results.get("drafter_attention", [])
    ]
    if split:
        heads = ["prefix", "batch", "splits", "us", "one split us", "roofline us", "max diff"]
        parts.append("Drafter attention, one layer (splits chosen against one split):\n\n"
                     + markdown_table(heads, split))  # fmt: skip
    tree = [
        [r["batch"], r["budget"], _us(r), _us(port, "us") if port else "-"]
        for r, port in _tree_pairs(results)
    ]
    if tree:
        heads = ["batch", "budget", "ours us (host)", "port us (host)"]
        parts.append("Greedy tree path per round:\n\n" + markdown_table(heads, tree))
    errors = results.get("errors", [])
    if errors:
        parts.append(
            "Sections that failed:\n\n" + "\n".join(f"- {e['section']}: {e['error']}" for e in errors)
        )
    return "\n\n".join(parts)


def earlier_run(path: Path, grid: dict, header: str) -> dict:
    """The results of an earlier run (--into), this run's header added; ValueError naming `into` when
    it was measured on another grid or split."""
    results = json.loads(path.read_text())
    if results.get("grid") != grid:
        raise ValueError(
            f"into: {path} was measured on another grid ({results.get('grid')}); pass the same arguments"
        )
    results["header"] += "\n\n" + header
    return results


def _tree_pairs(results: dict):
    port = {(r["batch"], r["budget"]): r for r in results.get("port_tree", [])}
    for r in results.get("tree", []):
        yield r, port.get((r["batch"], r["budget"]))


def main(args: argparse.Namespace) -> int:
    _check(args)
    if args.from_json is not None:
        print(write(json.loads(args.from_json.read_text()), args))
        return 0
    if not torch.cuda.is_available():
        raise ValueError(
            "device: bench kimi times CUDA graphs and needs a CUDA GPU (--from re-projects an "
            "earlier run's kimi_bench.json without one)"
        )
    from kdtree_engine.bench import kimi_measure
    from kdtree_engine.bench.timing import device_copy_bandwidth

    device = torch.device("cuda")
    copy_bw = device_copy_bandwidth(device)
    mode = ", row-invariant" if args.row_invariant else ""
    header = (
        f"Kimi-K2, one GPU's share (tp {args.tp}, ep {args.ep}{mode}), "
        f"bf16: {torch.cuda.get_device_name(device)}, "
        f"{utc_stamp()}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + written)\n\n"
        f"command: kdtree-engine bench kimi {' '.join(sys.argv[3:])}".rstrip()
    )
    shard = Shard(tp=args.tp, ep=args.ep)
    keys = ("batch", "tokens", "prefixes", "routings", "budgets", "tp", "ep", "row_invariant")
    grid = {k: getattr(args, k) for k in keys}
    grid["counts"] = dataclasses.asdict(counts_of(shard))
    results: dict = {"header": header, "grid": grid, "copy_GBps": copy_bw / 1e9, "errors": []}
    if args.into is not None:
        results = earlier_run(args.into, grid, header)

    def emit(section: str, row: dict) -> None:
        print(json.dumps({"section": section, **row}), flush=True)
        results.setdefault(section, []).append(row)
        write(results, args)  # after every row: a run cut short keeps what it measured

    run = SimpleNamespace(args=args, shard=shard, device=device, copy_bw=copy_bw, emit=emit)
    for section in args.sections:
        try:
            kimi_measure.SECTIONS[section](run)
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others' rows
            traceback.print_exc()
            results["errors"].append({"section": section, "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
    print(write(results, args))
    return 0
