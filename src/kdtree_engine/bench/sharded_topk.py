"""`kdtree-engine bench sharded-topk`: draft logits to tree on R tensor-parallel ranks, the drop-in's
exact sharded top-k against the SGLang DDTree port's, per decoding round.

As SGLang runs it: one process per rank (torch.multiprocessing spawn), a torch.distributed process
group (gloo on the CPU, NCCL with one GPU per rank), every rank holding its vocabulary shard of the
draft logits [B * L, V / R] (bf16: the vocab matmul's output, left out on both sides) and calling the
collectives of its round on that group. Per (batch B, budget), each rank times:
- ours: integrations.sglang.topk.shard_logits_topk (the drop-in's worker method after its matmul:
  shard_partials, two all-gathers, merge_gathered on every rank), then the drop-in's
  build_ddtree_tree_gpu into the port worker's buffers (on CUDA it replays a graph when a call repeats
  on the same tensors, integrations/sglang/replay.py, as inside SGLang; the top-k, which calls
  collectives, always runs eagerly);
- port: `port_draft_topk`, the port's `DDTreeWorkerV2._compute_draft_topk_log_probs_and_token_ids`
  after its matmul, reproduced with torch ops (its file is not loaded: it imports SGLang's scheduler);
  tests/bench/test_sharded_topk_bench.py checks the reproduction against the method itself, bit for
  bit, when the checkout holds ddtree_worker_v2.py. Then the port's own builder from the checkout
  (`--port`, loaded as bench/peers.py loads it): build_ddtree_tree_gpu (its Triton heap) on CUDA, its
  CPU builder build_ddtree_tree elsewhere, as its worker chooses.
- each side's top-k alone, its build alone (from its own top-k) and the round (top-k then build).
`k` is min(budget, V), the worker's proposal top-k.

Timing: collectives across processes are not captured in CUDA graphs here, so every time is the host
timer of the one harness (bench/timing.time_host: `--iters` back-to-back calls, the rank's GPU
synchronized before and after, median of `--reps`), ranks lined up by a barrier before each timing.
Reported: the maximum over ranks of each rank's median (the round ends when the slowest rank's does);
every rank's medians are in the json.

Checks, on every point (rank 0, untimed), recorded in the row and failing the command (exit 1):
- ours equals the drop-in's one-rank top-k of the whole vocabulary (whole_vocab_topk), bit for bit,
  on every rank;
- the port's top-k ids are ours up to ties: the same logits at its ids as at ours, in order, and the
  same ids wherever a value is above the k-th (torch.topk leaves the order and choice of tied values
  unspecified). "in order" counts the rows whose ids equal ours outright.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from kdtree_engine.bench.peers import SGLANG_FILE, SGLANG_TRITON_FILE, port_tree_buffers
from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.bench.timing import time_host
from kdtree_engine.integrations.sharded_topk import NORM_BLOCK

BACKENDS = ("gloo", "nccl")
DEFAULT_VOCAB = {"nccl": 163840, "gloo": 16384}  # Kimi-K2's; on the CPU the smallest 8 ranks take
MAX_BUDGET = 4096  # our builder's limit
SIDES, PARTS = ("port", "ours"), ("topk", "build", "round")
TIMES = [f"{s} {p}" for s in SIDES for p in PARTS]  # the order of the gathered medians


@dataclass(frozen=True)
class Config:
    """One run: what every rank gets (picklable, for spawn). port: the checkout, or None for the port's
    top-k alone (its builder then not timed)."""

    ranks: int
    backend: str
    batch: tuple[int, ...]
    budgets: tuple[int, ...]
    depth: int
    vocab: int
    iters: int
    reps: int
    seed: int
    port: str | None
    header: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=8, help="tensor-parallel ranks R, one process each")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="gloo: the CPU; nccl: one GPU per rank (default: nccl where CUDA is visible, "
                        "else gloo)")  # fmt: skip
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="batch sizes B")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64], help="tree budgets")
    parser.add_argument("--depth", type=int, default=15, help="draft block length L (Kimi DFlash: 15)")
    parser.add_argument("--vocab", type=int,
                        help="vocabulary V, a multiple of 2048 * ranks (default: 163840, Kimi-K2's, with "
                        "nccl; 16384 with gloo)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=10, help="back-to-back calls per timed run")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per rank (median reported)")
    parser.add_argument("--port", default=".peers/sglang", help="checkout of the SGLang DDTree port")
    parser.add_argument("--out", default="out/bench_sharded_topk", help="directory for the table and json")
    parser.add_argument("--seed", type=int, default=0)


def _at_least(name: str, values, low: int, high: int | None = None) -> None:
    for v in values:
        if v < low or (high is not None and v > high):
            bound = f">= {low}" if high is None else f"{low}..{high}"
            raise ValueError(f"--{name}: expected {bound}, got {v}")


def config(args: argparse.Namespace) -> Config:
    """The run's Config from the arguments; a ValueError naming the argument for a bad one."""
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _at_least("ranks", [args.ranks], 1)
    _at_least("batch", args.batch, 1)
    _at_least("budgets", args.budgets, 1, MAX_BUDGET)
    for name in ("depth", "iters", "reps"):
        _at_least(name, [getattr(args, name)], 1)
    vocab = DEFAULT_VOCAB[backend] if args.vocab is None else args.vocab
    if vocab < 1 or vocab % (NORM_BLOCK * args.ranks):
        raise ValueError(
            f"--vocab: expected a multiple of {NORM_BLOCK} * ranks = {NORM_BLOCK * args.ranks} (every shard "
            f"starts on a block of our normalizer), got {vocab}"
        )
    check_backend(backend, args.ranks)
    check_port(args.port)
    return Config(args.ranks, backend, tuple(args.batch), tuple(args.budgets), args.depth, vocab,
                  args.iters, args.reps, args.seed, args.port)  # fmt: skip


def check_backend(backend: str, ranks: int) -> None:
    """ValueError unless torch.distributed can run `ranks` ranks on `backend` here."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("--backend: torch.distributed is not available in this torch build")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("--backend: gloo is not available in this torch build")
    if backend == "nccl":
        visible = torch.cuda.device_count()
        if visible < ranks:
            raise ValueError(
                f"--ranks: --backend nccl runs one rank per GPU: {ranks} ranks, {visible} GPUs visible"
            )
        if not dist.is_nccl_available():
            raise ValueError("--backend: NCCL is not available in this torch build")


def check_port(path: str | None) -> None:
    """ValueError naming --port unless the checkout holds the port's builder files."""
    if path is None:
        return
    for f in (SGLANG_FILE, SGLANG_TRITON_FILE):
        if not (Path(path) / f).is_file():
            raise ValueError(
                f"--port: no {f} under {path} (scripts/fetch_peers.sh puts the SGLang DDTree port there)"
            )


# ---- the two sides ---------------------------------------------------------------------------------


def port_draft_topk(logits: torch.Tensor, id_map: torch.Tensor, topk: int, group):
    """The port's tensor-parallel draft top-k after its vocab matmul (Rancy-Wang/sglang ddtree-v2 at
    433c58e, python/sglang/srt/speculative/ddtree_worker_v2.py, DDTreeWorkerV2.
    _compute_draft_topk_log_probs_and_token_ids), its call sequence reproduced with torch ops:
    the shard's logits [T, Vs] copied to float32; the row maxima all-gathered, their maximum taken; the
    shard's exp-sums under it all-gathered and summed; log Z; the shard's torch.topk (k = min(topk, Vs)),
    padded to topk columns (-inf, id 0), mapped to global ids through `id_map` (its cached arange + shard
    start); values and ids all-gathered (two more collectives); torch.topk of the R * topk candidates and
    their ids gathered; values - log Z. -> (log-probs [T, topk] float32, ids [T, topk] int64)."""
    world, t, dev = group.world_size, logits.shape[0], logits.device
    local = logits.float()

    def gathered(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=dev)
        group.all_gather_into_tensor(out, x.contiguous())
        return out

    global_max = gathered(local.amax(dim=-1)).amax(dim=0)
    exp_sum = gathered(torch.exp(local - global_max[:, None]).sum(dim=-1)).sum(dim=0)
    log_z = global_max + torch.log(exp_sum.clamp_min(1e-38))
    local_k = min(topk, local.shape[-1])
    vals, idx = torch.topk(local, k=local_k, dim=-1)
    top_vals = torch.full((t, topk), -float("inf"), dtype=torch.float32, device=dev)
    top_ids = torch.zeros((t, topk), dtype=torch.long, device=dev)
    top_vals[:, :local_k], top_ids[:, :local_k] = vals, id_map[idx]
    if world == 1:
        return top_vals - log_z[:, None], top_ids
    flat_vals = gathered(top_vals).permute(1, 0, 2).reshape(t, -1)
    flat_ids = gathered(top_ids).permute(1, 0, 2).reshape(t, -1)
    best, pos = torch.topk(flat_vals, k=topk, dim=-1)
    return best - log_z[:, None], flat_ids.gather(1, pos)


def port_builder(path: str | None, device: torch.device):
    """build(lp, ids, budget, buffers): the port's tree build as its worker calls it (build_ddtree_tree_gpu
    with its Triton kernels on CUDA, build_ddtree_tree from the top-k elsewhere), or None without a
    checkout."""
    if path is None:
        return None
    from kdtree_engine.bench.peers import _exec_file, load_sglang_port

    if device.type == "cuda":
        utils = load_sglang_port(path).utils
        return lambda lp, ids, budget, bufs: utils.build_ddtree_tree_gpu(
            draft_top_log_probs=lp, draft_top_token_ids=ids, tree_budget=budget, device=device, **bufs
        )
    utils = _exec_file(Path(path) / SGLANG_FILE, "_sglang_port_ddtree_utils", {}, stable_topk=False)
    keep = ("_out_node_token_ids", "_out_node_depths", "_out_parents", "_out_visibility")
    return lambda lp, ids, budget, bufs: utils.build_ddtree_tree(
        None, budget, device, draft_top_log_probs=lp, draft_top_token_ids=ids, **{k: bufs[k] for k in keep}
    )


class Rank:
    """One rank's two sides at one (B, budget): its shard of the logits, the port worker's buffers."""

    def __init__(self, cfg: Config, group, rank: int, logits: torch.Tensor, budget: int, port_build):
        from kdtree_engine.integrations.sglang import build as B
        from kdtree_engine.integrations.sglang.topk import shard_logits_topk

        self.cfg, self.group, self.logits, self.budget = cfg, group, logits, budget
        self.shard = cfg.vocab // cfg.ranks
        self.start, self.k = rank * self.shard, min(budget, cfg.vocab)
        self.batch = logits.shape[0] // cfg.depth
        self.id_map = torch.arange(self.shard, device=logits.device) + self.start
        self.blocks = -(-self.shard // NORM_BLOCK)
        self.bufs = {s: port_tree_buffers(self.batch, budget, logits.device) for s in SIDES}
        self.ours_topk, self.ours_build = shard_logits_topk, B.build_ddtree_tree_gpu
        self.port_build = port_build
        self.out = {s: self.topk(s) for s in SIDES}

    def topk(self, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The side's top-k of the whole vocabulary, shaped [B, L, k] as the worker views it."""
        if side == "ours":
            lp, ids = self.ours_topk(self.logits, self.k, vocab_start=self.start, group=self.group,
                                      blocks=self.blocks)  # fmt: skip
        else:
            lp, ids = port_draft_topk(self.logits, self.id_map, self.k, self.group)
        shape = (self.batch, self.cfg.depth, self.k)
        return lp.view(shape), ids.view(shape)

    def build(self, side: str, lp: torch.Tensor, ids: torch.Tensor) -> None:
        if side == "ours":
            self.ours_build(draft_top_log_probs=lp, draft_top_token_ids=ids, tree_budget=self.budget,
                             device=lp.device, **self.bufs[side])  # fmt: skip
        elif self.port_build is not None:
            self.port_build(lp, ids, self.budget, self.bufs[side])

    def round(self, side: str) -> None:
        self.build(side, *self.topk(side))

    def calls(self) -> dict:
        """The timed callables, keyed as TIMES."""
        calls = {}
        for side in SIDES:
            calls[f"{side} topk"] = lambda s=side: self.topk(s)
            calls[f"{side} build"] = lambda s=side: self.build(s, *self.out[s])
            calls[f"{side} round"] = lambda s=side: self.round(s)
        return calls


# ---- checks ----------------------------------------------------------------------------------------


def same_up_to_ties(logits: torch.Tensor, port_ids: torch.Tensor, our_ids: torch.Tensor) -> dict:
    """logits [T, V] (the whole vocabulary), ids [T, k], ours sorted by value then id. `values`: the
    port's ids carry the same logits as ours, in order (both exact top-k); `above_kth`: the port's ids,
    ties put in id order, equal ours wherever the value is above the row's k-th (no choice there);
    `in_order`: rows whose ids equal ours outright."""
    x = logits.float()
    ours_v, port_v = x.gather(-1, our_ids), x.gather(-1, port_ids)
    by_id, _ = port_ids.sort(dim=-1)
    order = x.gather(-1, by_id).sort(dim=-1, descending=True, stable=True).indices
    port_canon = by_id.gather(-1, order)
    above = ours_v > ours_v[:, -1:]
    return {
        "values": bool(torch.equal(port_v, ours_v)),
        "above_kth": bool(torch.equal(port_canon[above], our_ids[above])),
        "in_order": int((port_ids == our_ids).all(dim=-1).sum()),
        "rows": int(our_ids.shape[0]),
    }


def check_point(logits: torch.Tensor | None, rank_out: dict, gathered: dict, k: int) -> dict:
    """Rank 0's checks at one point (see the module docstring). logits: the whole vocabulary's [T, V];
    rank_out: this rank's {side: (lp, ids)}; gathered: every rank's ours (lp [R, T, k], ids [R, T, k])."""
    from kdtree_engine.integrations.sglang.topk import whole_vocab_topk

    want_lp, want_ids = whole_vocab_topk(logits, k)
    lp_all, ids_all = gathered["lp"], gathered["ids"]
    one_rank = all(torch.equal(a, want_lp) and torch.equal(b, want_ids) for a, b in zip(lp_all, ids_all))
    port_lp, port_ids = (t.reshape(-1, k) for t in rank_out["port"])
    ties = same_up_to_ties(logits, port_ids, want_ids)
    return {
        "ours_equals_one_rank": one_rank,
        "port_ids_equal_up_to_ties": ties["values"] and ties["above_kth"],
        "port_rows_in_order": ties["in_order"],
        "rows": ties["rows"],
        "max_abs_logprob_diff": float((port_lp - want_lp).abs().max()),
    }


def passed(row: dict) -> bool:
    return row["ours_equals_one_rank"] and row["port_ids_equal_up_to_ties"]


# ---- one rank ----------------------------------------------------------------------------------------


def whole_logits(cfg: Config, batch: int, device: torch.device) -> torch.Tensor:
    """The draft logits of all ranks [B * L, V] bf16, the same on every rank (one seeded generator on the
    ranks' common device type), std 3: bf16 ties among the top-k are common, as in real drafts."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + batch)
    return (torch.randn(batch * cfg.depth, cfg.vocab, generator=gen, device=device) * 3).bfloat16()


def time_point(rank: Rank, cfg: Config, device: torch.device) -> list[float]:
    """This rank's median microseconds, in TIMES order; ranks lined up before each timing."""
    import torch.distributed as dist

    calls, medians = rank.calls(), []
    ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
    for name in TIMES:
        if name == "port build" and rank.port_build is None:
            medians.append(float("nan"))
            continue
        dist.barrier(group=rank.group.group, **ids)
        medians.append(time_host(calls[name], calls=cfg.iters, reps=cfg.reps, sync=device).median_us)
    return medians


def gather_all(group, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((group.world_size, *x.shape), dtype=x.dtype, device=x.device)
    group.all_gather_into_tensor(out, x.contiguous())
    return out


def run_point(cfg: Config, group, rank: int, logits: torch.Tensor, budget: int, port_build) -> dict | None:
    """One (B, budget) on this rank: the outputs, then the timings; rank 0 returns the row."""
    device = logits.device
    shard = logits[:, rank * cfg.vocab // cfg.ranks : (rank + 1) * cfg.vocab // cfg.ranks].contiguous()
    r = Rank(cfg, group, rank, shard, budget, port_build)
    ours = {"lp": gather_all(group, r.out["ours"][0].reshape(-1, r.k)),
            "ids": gather_all(group, r.out["ours"][1].reshape(-1, r.k))}  # fmt: skip
    row = check_point(logits, r.out, ours, r.k) if rank == 0 else None
    medians = gather_all(group, torch.tensor(time_point(r, cfg, device), dtype=torch.float64, device=device))
    if rank != 0:
        return None
    per_rank = medians.cpu().tolist()
    row = {"batch": r.batch, "budget": budget, "k": r.k, **row}
    for i, name in enumerate(TIMES):
        row[name] = max(m[i] for m in per_rank)
    row["per_rank_us"] = {name: [m[i] for m in per_rank] for i, name in enumerate(TIMES)}
    return row


def rank_main(rank: int, cfg: Config, store: str, out: str) -> None:
    """One tensor-parallel rank (torch.multiprocessing.spawn's entry): every point; rank 0 rewrites the
    table and json under `out` after each."""
    import torch.distributed as dist

    from kdtree_engine.integrations.sharded_topk import TorchGroup

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if cfg.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(cfg.backend, init_method=f"file://{store}", rank=rank, world_size=cfg.ranks,
                            timeout=timedelta(seconds=600))  # fmt: skip
    try:
        group = TorchGroup(dist.new_group(list(range(cfg.ranks))))  # SGLang's TP group is a group of its own
        port_build, rows = port_builder(cfg.port, device), []
        for batch in cfg.batch:
            logits = whole_logits(cfg, batch, device)
            for budget in cfg.budgets:
                row = run_point(cfg, group, rank, logits, budget, port_build)
                if row is not None:
                    rows.append(row)
                    write_results(cfg, rows, Path(out))
            del logits
    finally:
        dist.destroy_process_group()


# ---- the report ----------------------------------------------------------------------------------------


def _pair(p: float, o: float) -> str:
    if p != p:  # nan: the port's builder was not run
        return f"- / {o:.1f}"
    return f"{p:.1f} / {o:.1f} ({p / o:.1f}x)"


def report(cfg: Config, rows: list[dict]) -> str:
    heads = ["B", "budget"] + [f"{p} port / ours us (x)" for p in PARTS]
    heads += ["ours = one rank", "port ids = ours (ties aside)", "port rows in order", "max abs d log-prob"]
    table = []
    for r in rows:
        cells = [r["batch"], r["budget"]] + [_pair(r[f"port {p}"], r[f"ours {p}"]) for p in PARTS]
        cells += ["yes" if r["ours_equals_one_rank"] else "NO"]
        cells += ["yes" if r["port_ids_equal_up_to_ties"] else "NO", f"{r['port_rows_in_order']}/{r['rows']}"]
        cells += [f"{r['max_abs_logprob_diff']:.1e}"]
        table.append(cells)
    return cfg.header + "\n\n" + markdown_table(heads, table) + "\n"


def write_results(cfg: Config, rows: list[dict], out: Path) -> str:
    text = report(cfg, rows)
    (out / "sharded_topk.md").write_text(text)
    (out / "sharded_topk.json").write_text(json.dumps({"config": asdict(cfg), "rows": rows}, indent=1))
    return text


def header(cfg: Config, argv: list[str]) -> str:
    where = (
        f"{cfg.ranks} x {torch.cuda.get_device_name(0)}"
        if cfg.backend == "nccl"
        else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    )
    return (
        f"Draft logits to tree on {cfg.ranks} ranks, {cfg.backend}, {where}: B x L={cfg.depth} rows of bf16 "
        f"logits, V={cfg.vocab} ({cfg.vocab // cfg.ranks} per rank), k = min(budget, V); {utc_stamp()}\n\n"
        f"Times: host wall clock per call (time_host, device synchronized, median of {cfg.reps} runs of "
        f"{cfg.iters} calls), the maximum over ranks of each rank's median.\n\n"
        f"command: kdtree-engine bench sharded-topk {' '.join(argv)}".rstrip()
    )


def run(cfg: Config, out: Path) -> list[dict]:
    """Spawns the ranks; returns rank 0's rows (from the json it wrote)."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(cfg, str(Path(tmp) / "store"), str(out)), nprocs=cfg.ranks, join=True)
    return json.loads((out / "sharded_topk.json").read_text())["rows"]


def main(args: argparse.Namespace) -> int:
    cfg = config(args)
    cfg = replace(cfg, header=header(cfg, sys.argv[3:]))
    out = Path(args.out)
    rows = run(cfg, out)
    print((out / "sharded_topk.md").read_text())
    failed = [f"B={r['batch']} budget={r['budget']}" for r in rows if not passed(r)]
    if failed:
        print(f"kdtree-engine bench sharded-topk: checks failed at {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
