"""Worst-case inputs of the tree build from logits: time of build_tree_from_logits (top-k + normalizer +
best-first build, kernels) on ordinary and adversarial-but-legal bf16 logits, L = 15, V = 163840.

Run on the device:  PYTHONPATH=src python3 scripts/bench_plateau.py
Inputs: "random" randn * 3; "ties_heavy" round(randn) (about a thousand logits tie with the k-th);
"all_equal" every logit 0; "all_but_three" every logit 0 but three at 1, 2, 3. Timing: time_graph of
bench/timing.py (a CUDA graph of the call, replays timed by triton.testing.do_bench with the L2 flushed,
median in microseconds: the method of every benchmark, docs/results.md); checked equal to the reference.
"""

from __future__ import annotations

import torch

from kdtree_engine.bench.timing import time_graph
from kdtree_engine.tree import build_tree_from_logits

L, V, BUDGET = 15, 163840, 32


def inputs(b: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(b)
    x = torch.randn(b, L, V, device="cuda", generator=g)
    three = torch.zeros(b, L, V, device="cuda")
    three[..., [5, 70000, 163000]] = torch.tensor([1.0, 2.0, 3.0], device="cuda")
    return {
        "random": (3 * x).bfloat16(),
        "ties_heavy": torch.round(x).bfloat16(),
        "all_equal": torch.zeros(b, L, V, device="cuda", dtype=torch.bfloat16),
        "all_but_three": three.bfloat16(),
    }


def main() -> None:
    print(f"build_tree_from_logits, L={L}, V={V}, budget {BUDGET}, bf16, {torch.cuda.get_device_name()}")
    print("| B | input | us | / random | same trees as ref |")
    print("|---|---|---|---|---|")
    for b in (1, 64):
        base = None
        for name, logits in inputs(b).items():
            tree = build_tree_from_logits(logits, BUDGET, validate=False)
            ref = build_tree_from_logits(logits.cpu(), BUDGET, impl="ref")
            same = all(torch.equal(getattr(tree, f).cpu(), getattr(ref, f)) for f in ("tokens", "parents"))
            us = time_graph(lambda x=logits: build_tree_from_logits(x, BUDGET, validate=False)).median_us
            base = base or us
            print(f"| {b} | {name} | {us:.1f} | {us / base:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
