"""The Triton attention kernel's launch shape tried side by side (issue 29): for each decode-sized problem
(t * h <= 16, where the Triton kernel serves even on an H200) and each candidate, a forced `Config`
(block_m, block_n, warps, stages) or `hopper` (the Hopper kernel with its row minimum lifted: one 64-row
block for the few rows, where the cache is contiguous or in pages of 64), the GPU time of one call
(bench/timing.time_graph: CUDA-graph replays, the L2 flushed before each, medians; calls on distinct
copies of the cache past 256 MB, as bench attention) and the largest difference from the kernel's
default launch on the same inputs. The default is what `pick_config` chooses; the candidates come from
docs/notes/kernels.md (what the sm_90 code of each showed: copy buffers and copies in flight). Prints a
markdown table, writes it under $OUT when OUT is set (--table names the file). --splits adds a forced
split count to every candidate (the Triton kernel's KV splits; the Hopper kernel's pieces per row block;
0: the plan's own), for short caches where one program per row block leaves the chip idle.

    python scripts/tune_triton_attention.py [--heads 8] [--tokens 1] [--seqlens 8192 32768] \
        [--batch 1 16] [--page-sizes 0 64 1] [--configs 16,64,4,3 16,32,4,5 16,64,4,5 16,32,4,7 hopper] \
        [--splits 0 2 4]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from kdtree_engine.bench.attention import D_C, ROTATE_BYTES, make_problem
from kdtree_engine.bench.plot import markdown_table, utc_stamp
from kdtree_engine.kernels import mla_attention_triton as triton_attention

DEFAULT_CONFIGS = ("16,64,4,3", "16,32,4,5", "16,64,4,5", "16,32,4,7", "hopper")
HOPPER = "hopper"  # the Hopper kernel even below its MIN_ROWS, where it can read the cache
SCALE = 192**-0.5


def parse_config(text: str):
    """'block_m,block_n,warps,stages' -> Config, or 'hopper' (ValueError naming --configs otherwise)."""
    if text == HOPPER:
        return HOPPER
    try:
        block_m, block_n, warps, stages = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--configs: expected m,n,warps,stages or hopper, got {text!r}") from None
    return triton_attention.Config(block_m, block_n, warps, stages)


@contextlib.contextmanager
def forced(config):
    """Plans made inside take `config` for every call (None: the kernel's own choice; HOPPER: the Hopper
    kernel's row minimum lifted)."""
    from kdtree_engine.kernels import mla_attention_hopper as hopper

    chosen, min_rows = triton_attention.pick_config, hopper.MIN_ROWS
    if isinstance(config, triton_attention.Config):
        triton_attention.pick_config = lambda *_: config
    elif config == HOPPER:
        hopper.MIN_ROWS = 1
    try:
        yield
    finally:
        triton_attention.pick_config, hopper.MIN_ROWS = chosen, min_rows


def calls(problems: list[dict], config, splits: int = 0) -> list | None:
    """One planned call per problem (plans built with `config` and `splits` forced, outside any timing);
    None where the Hopper kernel cannot read the cache (pages not a multiple of 64)."""
    from kdtree_engine.attention import plan_attention

    out = []
    with forced(config):
        for p in problems:
            plan = plan_attention(p["q"], p["kv"], p["lengths"], softmax_scale=SCALE, d_v=D_C,
                                  visibility=p["vis"], block_table=p["block_table"],
                                  impl=None if config == HOPPER else "triton",
                                  num_splits=splits or None)  # fmt: skip
            if config == HOPPER and plan.kernel != "hopper":
                return None
            out.append(lambda plan=plan, p=p: plan.run(p["q"], p["kv"])[0])
    return out


def compare(problems: list[dict], configs: list, timer, splits: tuple[int, ...] = (0,)) -> list[dict]:
    """Per (config, split count) (None and 0 first: the default): time of one call by `timer(calls)` and
    the largest difference of the first problem's output from the default's (both None where it cannot
    run: no Hopper kernel for the cache, or buffers past the shared memory)."""
    base = calls(problems[:1], None)[0]()
    rows = []
    candidates = [(None, 0)] + [(c, s) for c in [None, *configs] for s in splits if (c, s) != (None, 0)]
    for config, split in candidates:
        planned = calls(problems, config, split)
        try:
            diff = None if planned is None else (planned[0]().float() - base.float()).abs().max().item()
        except OutOfResources:  # a launch shape whose buffers do not fit the shared memory
            planned = None
        if planned is None:
            rows.append({"config": config, "splits": split, "us": None, "max_diff": None})
            continue
        rows.append({"config": config, "splits": split, "us": timer(planned), "max_diff": diff})
    return rows


def point_rows(b, t, h, s, page, configs, rep_ms, device, splits=(0,)) -> list[list]:
    from kdtree_engine.bench.timing import time_graph

    copies = max(1, min(32, -(-ROTATE_BYTES // (b * s * 576 * 2))))
    problems = [make_problem(b, t, h, s, page, device, seed=i) for i in range(copies)]
    measured = compare(problems, configs, lambda c: time_graph(c, rep_ms=rep_ms, warmup=1).median_us, splits)
    default = measured[0]["us"]
    out = []
    for r in measured:
        c = r["config"]
        name = c or "default"
        if isinstance(c, triton_attention.Config):
            name = f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}"
        if r["splits"]:
            name = f"{name} / {r['splits']} splits"
        if r["us"] is None:
            out.append([h, t, s, b, page or "-", name, "-", "-", "-"])
            continue
        out.append([h, t, s, b, page or "-", name, f"{r['us']:.1f}", f"{default / r['us']:.2f}x",
                    f"{r['max_diff']:.2g}"])  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[0, 64, 1], help="0: contiguous")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="m,n,warps,stages each")
    parser.add_argument("--splits", type=int, nargs="+", default=[0], help="forced splits; 0: the plan's")
    parser.add_argument("--rep-ms", type=float, default=30)
    parser.add_argument("--table", default="tune_triton_attention.md", help="the table's file under $OUT")
    args = parser.parse_args()
    try:
        configs = [parse_config(c) for c in args.configs]
    except ValueError as exc:
        parser.exit(2, f"tune_triton_attention: {exc}\n")
    if not torch.cuda.is_available():
        parser.exit(2, "tune_triton_attention: needs a CUDA GPU\n")
    device = torch.device("cuda")
    table = []
    grid = itertools.product(args.heads, args.tokens, args.seqlens, args.batch, args.page_sizes)
    for h, t, s, b, page in grid:
        point = point_rows(b, t, h, s, page, configs, args.rep_ms, device, tuple(args.splits))
        print(point[0][:5], [r[5:8] for r in point], flush=True)
        table += point
    header = ["h", "t", "s", "b", "page", "config", "us", "default / this", "max diff"]
    text = (f"Triton attention launch shapes, {torch.cuda.get_device_name(device)}, {utc_stamp()}, bf16\n\n"
            + markdown_table(header, table))  # fmt: skip
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], args.table).write_text(text)


if __name__ == "__main__":
    main()
