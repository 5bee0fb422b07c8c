"""The verify attention of the 2.5B shape's forward (h = 16, a prefix of about 96 slots, batch 1 and 4)
by tree form and plan: one layer's plan_attention + run on a random tree given as the t x t visibility,
as ancestor bits (one int64 per query row), or as a causal mask (the floor of what the tree costs), with
the schedule planned on the host (the lengths known) or on the device (a captured forward's). Timing:
bench.timing.time_graph, 12 calls on 12 problems in one CUDA graph (a forward's layers), the L2 not
flushed (a short cache stays there in a forward), median per call; kernel: what the dispatch ran.

    python scripts/probe_verify_mask.py [--shapes 1,33,129 1,33,97 ...]   (b,t,s; s includes the t)
"""

from __future__ import annotations

import argparse

import torch

from kdtree_engine.attention import plan_attention
from kdtree_engine.bench.attention import make_problem
from kdtree_engine.bench.plot import markdown_table
from kdtree_engine.bench.timing import time_graph
from kdtree_engine.ref.sglang_attention import visibility_to_bits

HEADS = 16  # the 2.5B shape's heads
SCALE = 192**-0.5
LAYERS = 12
SHAPES = ("1,33,129", "1,33,97", "1,16,112", "1,65,161", "4,33,129", "1,1,97")


def tree_kwargs(tree: str, vis: torch.Tensor) -> dict:
    """plan_attention's tree argument for one form of the same tree."""
    if tree == "visibility":
        return {"visibility": vis}
    return {"ancestor_bits": visibility_to_bits(vis)} if tree == "bits" else {}


def layer_calls(b: int, t: int, s: int, tree: str, impl: str | None, on_device: bool):
    """LAYERS planned calls on distinct random problems, and the kernel the plan chose (None, None for
    bits of a tree of more than 64 nodes, which has none)."""
    if tree == "bits" and t > 64:
        return None, None
    calls, kernel = [], None
    for seed in range(LAYERS):
        p = make_problem(b, t, HEADS, s, 0, torch.device("cuda"), seed=seed)
        plan = plan_attention(p["q"], p["kv"], p["lengths"], softmax_scale=SCALE, d_v=512, impl=impl,
                              validate=not on_device, **tree_kwargs(tree, p["vis"]))  # fmt: skip
        calls.append(lambda plan=plan, p=p: plan.run(p["q"], p["kv"]))
        kernel = plan.kernel
    return calls, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="b,t,s each")
    parser.add_argument("--rep-ms", type=float, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "probe_verify_mask: needs a CUDA GPU\n")
    rows = []
    for shape in args.shapes:
        b, t, s = (int(x) for x in shape.split(","))
        for impl in (None, "triton"):
            for tree in ("visibility", "bits", "causal"):
                for on_device in (True, False):
                    calls, kernel = layer_calls(b, t, s, tree, impl, on_device)
                    if calls is None:
                        continue
                    us = time_graph(calls, rep_ms=args.rep_ms, flush_l2=False).median_us
                    rows.append([b, t, s, impl or "auto", kernel, tree, "device" if on_device else "host",
                                 f"{us:.1f}"])  # fmt: skip
                    print(rows[-1], flush=True)
    header = ["b", "t", "s", "impl", "kernel", "tree", "plan", "us per call"]
    print(f"{torch.cuda.get_device_name()}, h = {HEADS}, bf16\n\n" + markdown_table(header, rows))


if __name__ == "__main__":
    main()
