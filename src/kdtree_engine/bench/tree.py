"""`kdtree-engine bench tree`: our GPU tree path against the CPU builders serving engines run today.

Per (batch B, budget) on the same random bf16 drafter logits [B, L, V]; our kernels' columns are
labelled by the device they run on ("gpu ..." on CUDA; "cpu ..." on the CPU, where they run in the
Triton interpreter: a correctness run, far slower than any CPU code, so the CPU defaults are a small
size set that finishes in seconds):
- gpu topk->tree: kernels.build_tree from a precomputed top-k (the build alone);
- gpu logits->tree: top-k + log-softmax normalizer over V + build (kernels.build_tree_from_logits);
- gpu compile, gpu accept: compile_tree and accept_greedy on the built trees;
- cpu ref: ref.tree.build_tree from the same top-k on the host (the official heap, batched in Python);
- peers (`--peer official=/path/to/ddtree`): the official builder called once per request on that
  request's [L, V] logits as its engine does (top-k on the logits' device, copy to host, heap on host);
  `--peer sglang=/path/to/sglang`: SGLang's `build_ddtree_tree`, called once per batch on [B, L, V] as
  its worker does (its outputs padded on the logits' device). "<peer> same tree": the peer's tree for
  request 0, top-k ties pinned to our order, equals ours;
- `--peer sglang-triton=/path/to/sglang` (CUDA only): the SGLang DDTree port's GPU path
  (bench.peers.SglangTriton), timed like ours from the same inputs to the verify inputs: "logits->verify"
  (its worker's torch top-k and log Z, its build kernel, its verify-input kernel; ours:
  build_tree_from_logits + compile_tree) and "topk->verify" (the same top-k in: build + compile), ratios
  ours / port. "<peer> same trees": requests whose tree equals ours (token paths) on float32 logits
  without ties, from the same top-k and from logits; the port is not exact on ties.
Timed with the harness of every benchmark (bench/timing.py). GPU times (time_graph): a CUDA graph
holding `--graph-calls` back-to-back calls on the same inputs, replays timed by triton.testing.do_bench
for `--rep-ms` with the L2 flushed before each, the median per call (the calls after the first may find
inputs under the 50 MB L2 there, as the engine's tree ops find the logits the drafter just wrote).
Host times (time_host; the cpu columns, peers): the median wall clock over `--host-iters` runs after
one untimed run, the device synchronized around each. Ratios come from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from kdtree_engine.bench.plot import markdown_table, plot_series, utc_stamp
from kdtree_engine.bench.timing import time_graph, time_host

# Default sizes per device: the GPU's cover serving engines; the CPU's finish in seconds (the kernels
# run in the Triton interpreter there: about 1000x slower than on a GPU).
SIZES = {
    "cuda": {
        "batch": [1, 8, 64],
        "depth": 15,
        "budgets": [8, 16, 32, 64, 128],
        "vocab": 163840,
        "host_iters": 5,
    },
    "cpu": {"batch": [1, 2], "depth": 3, "budgets": [4, 8], "vocab": 256, "host_iters": 1},
}


def _size_help(name: str, what: str) -> str:
    return f"{what} (default: {SIZES['cuda'][name]} on CUDA, {SIZES['cpu'][name]} on the CPU)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch", type=int, nargs="+", default=None, help=_size_help("batch", "batch sizes B")
    )
    parser.add_argument("--depth", type=int, default=None, help=_size_help("depth", "draft block length L"))
    parser.add_argument("--budgets", type=int, nargs="+", default=None, help=_size_help("budgets", "budgets"))
    parser.add_argument("--vocab", type=int, default=None, help=_size_help("vocab", "vocabulary size V"))
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=PATH",
                        help="a peer from a local checkout: official, sglang, sglang-triton")  # fmt: skip
    parser.add_argument("--out", default="out/bench_tree", help="directory for the table, plot and json")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--graph-calls", type=int, default=10, help="calls captured per CUDA graph")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="ms of timed graph replays per figure")
    parser.add_argument(
        "--host-iters", type=int, default=None, help=_size_help("host_iters", "timed runs of host code")
    )
    parser.add_argument("--seed", type=int, default=0)


def _gpu_us(fn, calls: int, rep_ms: float) -> float:
    """Median GPU microseconds per call of fn: a CUDA graph of `calls` calls (bench/timing.time_graph)."""
    return time_graph(fn, calls=calls, rep_ms=rep_ms).median_us


def _host_us(fn, iters: int, device: torch.device) -> float:
    """Median wall-clock microseconds of fn over `iters` runs (bench/timing.time_host)."""
    return time_host(fn, reps=iters, sync=device).median_us


def _load_peers(specs: list[str]) -> tuple[dict, dict]:
    """Host peers {name: (run(logits [B, L, V], budget): the whole batch as the peer's engine calls it,
    with its own torch.topk; tree0(logits, budget) -> (tokens, parents) of request 0 with top-k ties
    pinned to ours)} and GPU peers {name: make(B, L, budget, device) -> peers.SglangTriton}."""
    from kdtree_engine.bench.peers import load_official, load_sglang, load_sglang_triton

    peers, gpu_peers = {}, {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if name == "official" and path:
            peers[name] = _official_peer(load_official(path, stable_topk=False), load_official(path))
        elif name == "sglang" and path:
            peers[name] = _sglang_peer(load_sglang(path, stable_topk=False), load_sglang(path))
        elif name == "sglang-triton" and path:
            gpu_peers[name] = load_sglang_triton(path)
        else:
            raise ValueError(
                f"--peer: expected official=PATH (ddtree), sglang=PATH or sglang-triton=PATH, got {spec!r}"
            )
    return peers, gpu_peers


def _official_peer(timed, pinned):
    """The official builder takes one request's [L, V] logits: its engine loops over the batch."""

    def run(logits, budget):
        return [timed(logits[r], budget) for r in range(logits.shape[0])]

    def tree0(logits, budget):
        tokens, _depths, parents, _seconds = pinned(logits[0], budget)
        return tokens, parents

    return run, tree0


def _sglang_peer(timed, pinned):
    """SGLang's builder takes the batch [B, L, V] in one call."""

    def tree0(logits, budget):
        tokens, _depths, parents = pinned(logits[:1], budget)[0]
        return tokens, parents

    return timed, tree0


def _same_tree(peer_tree, tree, r: int) -> bool:
    tokens, parents = peer_tree
    n = len(tokens)
    return (
        n == int(tree.num_nodes[r])
        and tokens.tolist() == tree.tokens[r, :n].tolist()
        and list(parents) == tree.parents[r, : n + 1].tolist()
    )


def _gpu_peer_row(name: str, make, budget: int, logits, lp, ids, roots, starts, timed, seed: int) -> dict:
    """Ours and the port from the same inputs to the verify inputs, and its trees against ours."""
    from kdtree_engine.bench.peers import token_paths
    from kdtree_engine.kernels.tree_build import build_tree
    from kdtree_engine.kernels.tree_compile import compile_tree
    from kdtree_engine.kernels.tree_topk import logits_topk
    from kdtree_engine.tree import build_tree_from_logits

    port = make(*logits.shape[:2], budget, logits.device)

    def ours(tree):
        return compile_tree(tree, roots, starts)

    def from_logits():
        return build_tree_from_logits(logits, budget, impl="triton", validate=False)

    row = {
        "gpu logits->verify": timed(lambda: ours(from_logits())),
        "gpu topk->verify": timed(lambda: ours(build_tree(lp, ids, budget))),
        f"{name} logits->verify": timed(lambda: port.from_logits(logits, roots, starts)),
        f"{name} topk->verify": timed(lambda: port.from_topk(lp, ids, roots, starts)),
    }
    gen = torch.Generator(logits.device).manual_seed(seed)
    fp32 = torch.randn(logits.shape, generator=gen, device=logits.device) * 2  # no ties in practice
    lp32, ids32 = logits_topk(fp32, min(budget, fp32.shape[-1]))
    tree = build_tree(lp32, ids32, budget)
    n, tokens, parents = tree.num_nodes.tolist(), tree.tokens.tolist(), tree.parents.tolist()
    want = [token_paths(tokens[r][: n[r]], parents[r]) for r in range(len(n))]
    for key, run in (("topk", lambda: port.from_topk(lp32, ids32, roots, starts)),
                     ("logits", lambda: port.from_logits(fp32, roots, starts))):  # fmt: skip
        run()
        got = zip(port.tokens.tolist(), port.parents.tolist())
        row[f"{name} same trees from {key}"] = sum(token_paths(*t) == w for t, w in zip(got, want))
    return row


def _label(device: torch.device) -> str:
    """The device our kernels run on, as the column labels say it: "gpu" or "cpu"."""
    return "gpu" if device.type == "cuda" else "cpu"


def _bench_config(b: int, budget: int, logits: torch.Tensor, peers: dict, gpu_peers: dict, args) -> dict:
    from kdtree_engine.kernels.tree_accept import accept_greedy
    from kdtree_engine.kernels.tree_build import build_tree
    from kdtree_engine.kernels.tree_compile import compile_tree
    from kdtree_engine.kernels.tree_topk import logits_topk
    from kdtree_engine.ref import tree as ref
    from kdtree_engine.tree import build_tree_from_logits

    dev = logits.device
    on_gpu = dev.type == "cuda"
    k = min(budget, logits.shape[-1])
    lp, ids = logits_topk(logits, k)
    tree = build_tree(lp, ids, budget)
    roots = torch.zeros(b, dtype=torch.int64, device=dev)
    starts = torch.full((b,), 100, dtype=torch.int64, device=dev)
    # targets = the next node's token: long accepts on chain-like trees
    target = compile_tree(tree, roots, starts).input_ids.roll(-1, dims=1).contiguous()

    def timed(fn):
        return _gpu_us(fn, args.graph_calls, args.rep_ms) if on_gpu else _host_us(fn, args.host_iters, dev)

    dev_label = _label(dev)
    row = {"B": b, "budget": budget}
    row[f"{dev_label} topk->tree"] = timed(lambda: build_tree(lp, ids, budget))
    row[f"{dev_label} logits->tree"] = timed(
        lambda: build_tree_from_logits(logits, budget, impl="triton", validate=False)
    )
    row[f"{dev_label} compile"] = timed(lambda: compile_tree(tree, roots, starts))
    row[f"{dev_label} accept"] = timed(lambda: accept_greedy(tree, target))
    lp_host, ids_host = lp.cpu(), ids.cpu()
    want = ref.build_tree(lp_host, ids_host, budget)
    row["exact vs ref"] = all(
        torch.equal(getattr(tree, f).cpu(), getattr(want, f)) for f in ("tokens", "parents")
    )
    row["cpu ref"] = _host_us(lambda: ref.build_tree(lp_host, ids_host, budget), args.host_iters, dev)
    for name, (run, tree0) in peers.items():
        row[name] = _host_us(lambda f=run: f(logits, budget), args.host_iters, dev)
        row[f"{name} same tree"] = _same_tree(tree0(logits, budget), tree, 0)
    for name, make in gpu_peers.items():
        if on_gpu:
            row |= _gpu_peer_row(name, make, budget, logits, lp, ids, roots, starts, timed, args.seed)
    return row


def _ratio(a: float | None, b: float | None) -> str | None:
    return None if a is None or b is None else f"{a / b:.3g}x"


def _report(
    rows: list[dict], peers: list[str], gpu_peers: list[str], header: str, out: Path, dev_label: str
) -> str:
    ours = [f"{dev_label} {c}" for c in ("topk->tree", "logits->tree", "compile", "accept")]
    cols = ours + (["gpu topk->verify", "gpu logits->verify"] if gpu_peers else [])
    cols += ["cpu ref", *peers, *[f"{p} {c}" for p in gpu_peers for c in ("topk->verify", "logits->verify")]]
    ratios = [("cpu ref", ours[0])] + [(p, c) for p in peers for c in ours[:2]]
    ratios += [(f"gpu {c}", f"{p} {c}") for p in gpu_peers for c in ("topk->verify", "logits->verify")]
    same = [f"{p} same trees from {k}" for p in gpu_peers for k in ("topk", "logits")]
    headers = ["B", "budget", *[f"{c} (us)" for c in cols], *[f"{a} / {b_}" for a, b_ in ratios], "exact"]
    headers += [f"{c} (of B)" for c in same]
    table = []
    for r in rows:
        exact = r["exact vs ref"] and all(r[f"{p} same tree"] for p in peers)
        times = [r.get(c) for c in cols]
        table.append([r["B"], r["budget"], *times, *[_ratio(r.get(a), r.get(b_)) for a, b_ in ratios], exact])
        table[-1] += [r.get(c) for c in same]
    text = f"{header}\n\n{markdown_table(headers, table)}\n"
    if gpu_peers:
        text += (
            f"\n{', '.join(gpu_peers)}: the SGLang DDTree port (CUDA only; '-' without CUDA), not exact "
            "on ties: equal scores pop the candidate pushed first, and torch.topk orders tied logits its own "
            "way. 'same trees': requests whose tree equals ours on float32 logits without ties.\n"
        )
    labels = [f"B={r['B']} n={r['budget']}" for r in rows]
    plotted = plot_series(
        out / "tree_bench.png", header.splitlines()[0], labels, {c: [r.get(c) for r in rows] for c in cols}
    )
    return text + ("" if plotted else "\n(matplotlib missing: no plot written)\n")


def _fill_sizes(args: argparse.Namespace, device: torch.device) -> None:
    """The sizes left out take the device's defaults (SIZES)."""
    for name, value in SIZES["cuda" if device.type == "cuda" else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(args: argparse.Namespace) -> int:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    _fill_sizes(args, device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run through the Triton interpreter
        print("CPU: our kernels run in the Triton interpreter (a correctness run; their times are not "
              "CPU speeds), small default sizes", file=sys.stderr)  # fmt: skip
    peers, gpu_peers = _load_peers(args.peer)
    if gpu_peers and device.type != "cuda":
        print(f"{', '.join(gpu_peers)}: needs CUDA, skipped", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU (Triton interpreter), torch {torch.__version__}"
    )
    stamp = utc_stamp()
    header = (
        f"DDTree tree ops, L={args.depth}, V={args.vocab}, bf16 logits: {name}, {stamp}\n\n"
        f"command: kdtree-engine bench tree {' '.join(sys.argv[3:]) if len(sys.argv) > 3 else ''}".rstrip()
    )
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for b in args.batch:
        logits = (torch.randn(b, args.depth, args.vocab, generator=gen) * 2).bfloat16().to(device)
        for budget in args.budgets:
            rows.append(_bench_config(b, budget, logits, peers, gpu_peers, args))
            print(json.dumps(rows[-1]), flush=True)
    text = _report(rows, list(peers), list(gpu_peers), header, out, _label(device))
    (out / "tree_bench.md").write_text(text)
    (out / "tree_bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(text)
    return 0
