"""Probe of the vocabulary top-k (kernels/tree_topk.py) on one GPU: its two launches (partials, select)
timed alone and together, registers and spills of each as loaded by the driver, checked against the
reference; and the read floor of the same logits.

Run on the device:  PYTHONPATH=src python3 scripts/probe_topk.py --out $OUT/topk [--sweep]
Shapes: B = 64, L = 15, V = 163840, k = 32, bf16 logits; inputs "random" (randn), "ties" (round(3 randn):
many exact ties) and "ties_heavy" (round(randn): ~1000 logits tie with the k-th, the select's bisection
path; a shorter timing). --sweep: other launch shapes of the same kernels, on "random".
Timing: time_graph of bench/timing.py (the method of every benchmark, docs/results.md): a CUDA graph
holding 10 calls, replays timed by triton.testing.do_bench with the L2 flushed before each, median per
call; where capture fails, time_host (wall clock of 10 eager calls, median of 20 runs; the row says so).
Read floor: a Triton kernel that only reads the logits (16-byte loads), `torch.amax(logits, dim=-1)` and
a `dst.copy_(logits)` (read + write). Exactness: ids and log-probs equal (torch.equal) to
ref.tree.logits_to_topk run on the same device (the reference gives the same bits on every device:
tests/kernels/test_tree_topk_gpu.py). A failing row is reported and the probe goes on; no new row
starts after --budget-s seconds.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from kdtree_engine.bench.timing import time_graph, time_host
from kdtree_engine.kernels import tree_topk
from kdtree_engine.ref import tree as ref
from kdtree_engine.tree import build_tree_from_logits

B, L, V, K = 64, 15, 163840, 32
REP_MS, PER_GRAPH, HOST_REPS = 100.0, 10, 20
DEFAULT = ("default", {})
SWEEP = [  # launch shapes of the same two kernels (same output)
    ("partials 2 warps", {"partial_warps": 2}),
    ("partials 4 warps", {"partial_warps": 4}),
    ("select 4 warps", {"select_warps": 4}),
    ("select 2 warps maxnreg 96", {"select_warps": 2, "select_maxnreg": 96}),
]


def time_us(fn, rep_ms: float = REP_MS, row: dict | None = None) -> float:
    """Median microseconds per call: a CUDA graph of PER_GRAPH calls (time_graph), or the wall clock of
    PER_GRAPH eager calls (time_host) if capture fails, noted in `row` ("timing": "host")."""
    try:
        return time_graph(fn, calls=PER_GRAPH, rep_ms=rep_ms).median_us
    except Exception:  # noqa: BLE001 - fall back to plain launches
        torch.cuda.synchronize()
        if row is not None:
            row["timing"] = "host"
        return time_host(fn, calls=PER_GRAPH, reps=HOST_REPS, sync="cuda").median_us


def make_inputs(dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, L, V, generator=g, device=dev)
    return {
        "random": x.bfloat16(),
        "ties": torch.round(3 * x).bfloat16(),
        "ties_heavy": torch.round(x).bfloat16(),
    }


def probe(name, knobs, x, want, kind: str, rep_ms: float) -> dict:
    row = {"input": kind, "variant": name, "knobs": {key: str(v) for key, v in knobs.items()}}
    try:
        lp, ids, launches = tree_topk.topk_launches(x, K, **knobs)
        row["regs/spills"] = " + ".join(
            f"{getattr(h, 'n_regs', '?')}/{getattr(h, 'n_spills', '?')}"
            for h in (launch() for launch in launches)
        )
        torch.cuda.synchronize()
        row["ok"] = bool(torch.equal(ids, want[1]) and torch.equal(lp, want[0]))
        row["partials_us"] = time_us(launches[0], rep_ms, row)
        row["select_us"] = time_us(launches[1], rep_ms, row)  # on the partials just written
        row["total_us"] = time_us(lambda: tree_topk.logits_topk(x, K, **knobs), rep_ms, row)
    except Exception as exc:  # noqa: BLE001 - report and go on
        row["ok"] = False
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    shown = {key: v for key, v in row.items() if key not in ("input", "variant")}
    print(f"  {kind:10s} {name:28s} {json.dumps(shown)}")
    return row


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, CH: tl.constexpr):
    """Reads CH elements (16-byte vectors) and writes their float32 sum: a pure read of the logits."""
    offs = tl.program_id(0).to(tl.int64) * CH + tl.arange(0, CH)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < N).to(tl.float32)))


def floors(x) -> list[dict]:
    dst = torch.empty_like(x)
    cases = [("read floor: torch.amax(logits, -1)", lambda: torch.amax(x, dim=-1)),
             ("read+write: dst.copy_(logits)", lambda: dst.copy_(x))]  # fmt: skip
    for chunk, warps in ((8192, 4), (16384, 8)):
        sums = torch.empty(triton.cdiv(x.numel(), chunk), dtype=torch.float32, device=x.device)
        launch = partial(_read_kernel[(sums.numel(),)], x, sums, x.numel(), CH=chunk, num_warps=warps)
        cases.append((f"read floor: Triton sum ch={chunk} w={warps}", launch))
    out = []
    gb = x.numel() * x.element_size() / 1e9
    for name, fn in cases:
        try:
            row = {}
            us = time_us(fn, row=row)
            out.append(
                {
                    "input": "random",
                    "variant": name,
                    "total_us": us,
                    "GB/s (read)": gb / (us * 1e-6),
                    "ok": True,
                    **row,
                }
            )
        except Exception as exc:  # noqa: BLE001
            out.append({"input": "random", "variant": name, "ok": False, "error": repr(exc)})
    return out


def build_row(x, want, budget: int = K) -> dict:
    row = {"input": "random", "variant": f"build_tree_from_logits budget {budget}"}
    try:
        tree = build_tree_from_logits(x, budget, impl="triton", validate=False)
        expect = ref.build_tree(*want, budget)
        row["ok"] = all(torch.equal(getattr(tree, f), getattr(expect, f)) for f in ("tokens", "parents"))
        row["total_us"] = time_us(
            partial(build_tree_from_logits, x, budget, impl="triton", validate=False), row=row
        )
    except Exception as exc:  # noqa: BLE001
        row["ok"], row["error"] = False, f"{type(exc).__name__}: {exc}"
    print(f"  {row}")
    return row


def table(rows: list[dict]) -> str:
    cols = [
        "input",
        "variant",
        "partials_us",
        "select_us",
        "regs/spills",
        "total_us",
        "GB/s (read)",
        "ok",
        "error",
        "timing",
    ]

    def fmt(v) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) if c in r else "" for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/topk"))
    ap.add_argument("--budget-s", type=float, default=200.0, help="no new row starts after this")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP launch shapes (random only)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    inputs = make_inputs(torch.device("cuda"))
    wants = {kind: ref.logits_to_topk(x, K) for kind, x in inputs.items()}
    rows = floors(inputs["random"])
    plan = [(DEFAULT, kind, REP_MS) for kind in ("random", "ties")]
    plan += [(s, "random", REP_MS) for s in (SWEEP if args.sweep else ())] + [(DEFAULT, "ties_heavy", 10.0)]
    for (name, knobs), kind, rep_ms in plan:
        if time.monotonic() - start > args.budget_s:
            rows.append({"input": kind, "variant": name, "ok": False, "error": "skipped: time budget"})
            continue
        rows.append(probe(name, knobs, inputs[kind], wants[kind], kind, rep_ms))
    if time.monotonic() - start < args.budget_s + 20:
        rows.append(build_row(inputs["random"], wants["random"]))
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "B": B,
        "L": L,
        "V": V,
        "k": K,
    }
    meta["seconds"] = round(time.monotonic() - start, 1)
    meta["timing"] = (
        f"bench/timing.time_graph: CUDA graph of {PER_GRAPH} calls, do_bench median over {REP_MS:g} ms of "
        "replays (10 ms for ties_heavy), L2 flushed before each"
    )
    md = f"{json.dumps(meta)}\n\n{table(rows)}\n"
    print(md)
    (args.out / "probe_topk.md").write_text(md)
    (args.out / "probe_topk.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
