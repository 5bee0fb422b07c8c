"""`kdtree-engine bench tree` labels our kernels' figures by the device they ran on, and on the CPU
(where the kernels run in the Triton interpreter) takes a small default size set."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kdtree_engine.bench import tree as bench_tree
from kdtree_engine.cli import main


def test_default_sizes_follow_the_device():
    args = argparse.Namespace(batch=None, depth=None, budgets=[16], vocab=None, host_iters=None)
    bench_tree._fill_sizes(args, torch.device("cpu"))
    assert (args.batch, args.depth, args.budgets, args.vocab, args.host_iters) == ([1, 2], 3, [16], 256, 1)
    args = argparse.Namespace(batch=None, depth=None, budgets=None, vocab=None, host_iters=None)
    bench_tree._fill_sizes(args, torch.device("cuda"))
    assert args.vocab == 163840 and args.budgets == [8, 16, 32, 64, 128]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU labels")
def test_cpu_figures_are_labelled_cpu(tmp_path, capsys):
    argv = ["bench", "tree", "--batch", "1", "--depth", "2", "--budgets", "3", "--vocab", "40"]
    assert main([*argv, "--rep-ms", "5", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "tree_bench.json").read_text())["rows"][0]
    assert {"cpu topk->tree", "cpu logits->tree", "cpu compile", "cpu accept"} <= set(row)
    table = (tmp_path / "tree_bench.md").read_text()
    assert "cpu ref / cpu topk->tree" in table and "gpu" not in table.split("\n| B |")[1]
    assert "Triton interpreter" in capsys.readouterr().err
