"""Probe of the vocab-wide top-k (kernels/tree_topk.py) on one GPU: each select variant and knob setting
timed per launch (partials alone, select alone; the one launch of "fused") and whole, checked against
the reference; registers and spills of each launch as loaded by the driver.

Run on the device:  PYTHONPATH=src python3 scripts/probe_topk.py --out $OUT/topk
Shapes: B = 64, L = 15, V = 163840, k = 32, bf16 logits; inputs "random" (randn, bf16), "ties"
(round(3 randn), bf16: many exact ties) and "ties_heavy" (round(randn): ~1000 logits tie with the
k-th, the bisection path; "fused" and "thresh" only, fewer repeats). "kept counter": the fused launch
with a caller-kept zeroed counter (no per-call memset; total_us shows the memset's cost).
Timing: CUDA graph holding 10 calls, replayed after warm-up; median over >= 20 replays, per call.
Read floor: `torch.amax(logits, dim=-1)` (reads the bf16 logits once, writes 960 values) and a
`dst.copy_(logits)` (reads + writes). Exactness: ids equal ref.tree.logits_to_topk exactly (tie
order included), log-probs within 1e-5. A failing variant is reported and the sweep goes on; the
sweep stops starting new variants after --budget-s seconds (default 200).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import tree as kernels
from kdtree_engine.kernels import tree_topk
from kdtree_engine.ref import tree as ref

B, L, V, K = 64, 15, 163840, 32
REPS, PER_GRAPH = 20, 10
KEPT = "kept"  # knob value: a zeroed counter buffer made once per input and reused
VARIANTS = [  # (name, knobs); measured 2026-12-02: see docs/tree_kernels.md
    ("thresh (default, ch=2048 pw=1 S=1024 sw=2 maxnreg=128)", {}),
    ("thresh select_warps=4 (earlier default)", {"select_warps": 4}),
    ("thresh ch=8192 pw=4 sw=4 (older default)", {"chunk": 8192, "partial_warps": 4, "select_warps": 4}),
    ("fused (ch=8192 S=512)", {"variant": "fused"}),
    ("fused kept counter", {"variant": "fused", "counter": KEPT}),
    ("fused S=1024", {"variant": "fused", "super_group": 1024}),
    ("compact (older)", {"variant": "compact"}),
]
SLOW_PATH = [VARIANTS[0], VARIANTS[3]]  # the default and "fused", run on "ties_heavy"
SWEEP = [  # --sweep: launch-shape knobs of the default "thresh", on "random" only. Measured 14:13 UTC:
    # partial / select warps 2 / 8, chunk 16384, groups of 16 / 64 were slower than ch=8192 pw=4; 14:34
    # UTC: a persistent partials launch (next chunk loaded during this one's math) took 145-213 us;
    # 14:46 UTC: one warp per 2048 logits 89 us (4096: 92; 2 warps per 4096: 95), per-group exps slower;
    # 14:51 UTC: chunks of 1024 or 2 warps per 2048 slower, S = 2048 the same. 15:33 UTC, the select's
    # register cap (4 warps took 122 registers: 4 rows resident per multiprocessor, 960 rows in two
    # rounds): 4 warps capped at 64 / 96 34.8 / 36.3 us, 8 warps at 64 45.5, 2 warps at 128 29.4 (the
    # new default for many rows), against 36.6 for 4 warps uncapped.
    ("thresh select_warps=2 maxnreg=96", {"select_warps": 2, "select_maxnreg": 96}),
    ("thresh select_warps=1 maxnreg=128", {"select_warps": 1, "select_maxnreg": 128}),
    ("thresh group_exp", {"group_exp": True}),
]


def time_us(fn, reps: int = REPS) -> float:
    """Median microseconds per call: a CUDA graph of PER_GRAPH calls replayed `reps` times (CUDA events
    around PER_GRAPH plain calls if capture fails)."""
    fn()
    torch.cuda.synchronize()
    run = lambda: [fn() for _ in range(PER_GRAPH)]  # noqa: E731
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    except Exception:  # noqa: BLE001 - fall back to plain launches
        torch.cuda.synchronize()
    run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / PER_GRAPH)
    return statistics.median(times)


def make_inputs(dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, L, V, generator=g, device=dev)
    return {
        "random": x.bfloat16(),
        "ties": torch.round(3 * x).bfloat16(),
        "ties_heavy": torch.round(x).bfloat16(),
    }


def check(x, want, knobs) -> tuple[bool, float]:
    lp, ids = tree_topk.logits_topk(x, K, **knobs)
    lp2, ids2 = tree_topk.logits_topk(x, K, **knobs)  # a second call: the fused counters were reset
    torch.cuda.synchronize()
    exact = torch.equal(ids, want[1]) and torch.equal(ids2, want[1])
    return bool(exact), float(max((lp - want[0]).abs().max(), (lp2 - want[0]).abs().max()))


def regs(launched) -> str:
    """'regs/spills' of a launch's compiled kernel (what Triton's launcher returns)."""
    return f"{getattr(launched, 'n_regs', '?')}/{getattr(launched, 'n_spills', '?')}"


def probe_variant(name, knobs, x, want, kind: str, reps: int) -> dict:
    row = {"input": kind, "variant": name, "knobs": {key: str(v) for key, v in knobs.items()}}
    if knobs.get("counter") == KEPT:
        knobs = {**knobs, "counter": torch.zeros(B * L, dtype=torch.int32, device=x.device)}
    try:
        row["ids_exact"], row["max_lp_err"] = check(x, want, knobs)
        row["ok"] = row["ids_exact"] and row["max_lp_err"] <= 1e-5
        lp, ids, stages = tree_topk._plan(x, K, **knobs)
        row["regs/spills"] = " + ".join(regs(launch()) for launch in stages)
        if len(stages) == 2:
            row["partials_us"] = time_us(stages[0], reps)
            row["select_us"] = time_us(stages[1], reps)  # on the partials just written
        else:
            row["fused_us"] = time_us(stages[0], reps)  # the one launch, its counter reused: no memset
            row["ids_exact"] = row["ids_exact"] and bool(torch.equal(ids, want[1]))  # after the replays
            row["ok"] = row["ok"] and row["ids_exact"]
        row["total_us"] = time_us(lambda: tree_topk.logits_topk(x, K, **knobs), reps)
    except Exception as exc:  # noqa: BLE001 - report and go on
        row["ok"] = False
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    shown = {key: v for key, v in row.items() if key not in ("input", "variant")}
    print(f"  {kind:10s} {name:24s} {json.dumps(shown)}")
    return row


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, CH: tl.constexpr):
    """Reads CH elements (16-byte vectors) and writes their float32 sum: a pure read of the logits."""
    offs = tl.program_id(0).to(tl.int64) * CH + tl.arange(0, CH)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < N).to(tl.float32)))


def triton_read(x, chunk: int, warps: int):
    sums = torch.empty(triton.cdiv(x.numel(), chunk), dtype=torch.float32, device=x.device)
    return partial(_read_kernel[(sums.numel(),)], x, sums, x.numel(), CH=chunk, num_warps=warps)


def floors(x) -> list[dict]:
    out = []
    dst = torch.empty_like(x)
    cases = [("read floor: torch.amax(logits, -1)", lambda: torch.amax(x, dim=-1)),
             ("read+write: dst.copy_(logits)", lambda: dst.copy_(x))]  # fmt: skip
    for chunk, warps in ((8192, 4), (16384, 8), (32768, 8)):
        cases.append((f"read floor: Triton sum ch={chunk} w={warps}", triton_read(x, chunk, warps)))
    for name, fn in cases:
        try:
            out.append({"input": "random", "variant": name, "total_us": time_us(fn), "ok": True})
        except Exception as exc:  # noqa: BLE001
            out.append({"input": "random", "variant": name, "ok": False, "error": repr(exc)})
    gb = x.numel() * x.element_size() / 1e9
    for r in out:
        if "total_us" in r:
            r["GB/s (read)"] = gb / (r["total_us"] * 1e-6)
    return out


def build_rows(x, budget: int = 32) -> list[dict]:
    out = []
    for v in ("fused", "thresh"):
        row = {"input": "random", "variant": f"build_tree_from_logits budget {budget} topk_variant={v}"}
        try:
            tree = kernels.build_tree_from_logits(x, budget, topk_variant=v)
            lp, ids = ref.logits_to_topk(x, budget)
            want = ref.build_tree(lp.cpu(), ids.cpu(), budget)
            row["ok"] = all(
                torch.equal(getattr(tree, f).cpu(), getattr(want, f)) for f in ("tokens", "parents")
            )
            row["total_us"] = time_us(partial(kernels.build_tree_from_logits, x, budget, topk_variant=v))
        except Exception as exc:  # noqa: BLE001
            row["ok"], row["error"] = False, f"{type(exc).__name__}: {exc}"
        print(f"  {row}")
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    cols = [
        "input",
        "variant",
        "partials_us",
        "select_us",
        "fused_us",
        "regs/spills",
        "total_us",
        "GB/s (read)",
        "ids_exact",
        "max_lp_err",
        "ok",
        "error",
    ]

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.1f}" if v > 0.01 else f"{v:.1e}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) if c in r else "" for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/topk"))
    ap.add_argument("--budget-s", type=float, default=200.0, help="no new variant starts after this")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP knob settings (random only)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    dev = torch.device("cuda")
    inputs = make_inputs(dev)
    wants = {kind: ref.logits_to_topk(x, K) for kind, x in inputs.items()}
    rows = floors(inputs["random"])
    for kind in ("random", "ties"):
        for name, knobs in VARIANTS:
            if time.monotonic() - start > args.budget_s:
                rows.append({"input": kind, "variant": name, "ok": False, "error": "skipped: time budget"})
                continue
            rows.append(probe_variant(name, knobs, inputs[kind], wants[kind], kind, REPS))
    for name, knobs in SWEEP if args.sweep else ():
        if time.monotonic() - start > args.budget_s:
            break
        rows.append(probe_variant(name, knobs, inputs["random"], wants["random"], "random", REPS))
    for name, knobs in SLOW_PATH:  # slow path stress: few repeats, guarded
        if time.monotonic() - start > args.budget_s:
            break
        rows.append(probe_variant(name, knobs, inputs["ties_heavy"], wants["ties_heavy"], "ties_heavy", 3))
    if time.monotonic() - start < args.budget_s + 20:
        rows += build_rows(inputs["random"])
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "B": B,
        "L": L,
        "V": V,
        "k": K,
    }
    meta["seconds"] = round(time.monotonic() - start, 1)
    meta["timing"] = f"CUDA graph of {PER_GRAPH} calls, median of {REPS} replays"
    md = f"{json.dumps(meta)}\n\n{table(rows)}\n"
    print(md)
    (args.out / "probe_topk.md").write_text(md)
    (args.out / "probe_topk.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
