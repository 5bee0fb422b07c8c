"""`kdtree-engine bench tree` at tiny settings (CPU: kernels through the interpreter), and the SGLang
DDTree port (Rancy-Wang/sglang, branch ddtree-v2) against ours when its files are at .peers/sglang
(scripts/fetch_peers.sh) or KDTREE_SGLANG_DDTREE names a checkout: its CPU builder on the CPU, its
Triton builder (bench.peers.SglangTriton) on CUDA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kdtree_engine.bench import peers
from kdtree_engine.cli import main
from kdtree_engine.ref.tree import topk_stable
from kdtree_engine.tree import build_tree, build_tree_from_logits, compile_tree

TINY = ["bench", "tree", "--batch", "2", "--depth", "2", "--budgets", "3", "--vocab", "40"]
TINY += ["--host-iters", "1", "--rep-ms", "5", "--graph-calls", "2"]
PORT = Path(os.environ.get("KDTREE_SGLANG_DDTREE", Path(__file__).parents[2] / ".peers" / "sglang"))
needs_port = pytest.mark.skipif(
    not (PORT / peers.SGLANG_TRITON_FILE).is_file(), reason=f"no SGLang DDTree port at {PORT}"
)


def test_bench_tree_smoke(tmp_path):
    assert main([*TINY, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tree_bench.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["exact vs ref"]
    assert "| B | budget |" in (tmp_path / "tree_bench.md").read_text()


def test_sglang_triton_peer_is_checked_then_skipped_without_cuda(tmp_path):
    with pytest.raises(ValueError, match="^path: no python/sglang/kernels"):
        peers.load_sglang_triton(tmp_path)
    stand_in = tmp_path / "sglang" / peers.SGLANG_TRITON_FILE
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("def build_ddtree_tree_triton(**kw): ...\n")
    with pytest.raises(ValueError, match="has no compile_ddtree_tree_triton"):
        peers.load_sglang_triton(tmp_path / "sglang")
    if torch.cuda.is_available():
        return
    stand_in.write_text(stand_in.read_text() + "def compile_ddtree_tree_triton(**kw): ...\n")
    assert main([*TINY, "--out", str(tmp_path), "--peer", f"sglang-triton={tmp_path / 'sglang'}"]) == 0
    row = json.loads((tmp_path / "tree_bench.json").read_text())["rows"][0]
    assert row["exact vs ref"] and "sglang-triton logits->verify" not in row
    assert "not exact on ties" in (tmp_path / "tree_bench.md").read_text()


def test_token_paths_ignore_node_order():
    # root -> 5 -> 7 and root -> 6, numbered two ways
    assert peers.token_paths([5, 6, 7], [-1, 0, 0, 1]) == peers.token_paths([6, 5, 7], [-1, 0, 0, 2])
    assert peers.token_paths([5, 6, 7], [-1, 0, 0, 1]) != peers.token_paths([5, 6, 7], [-1, 0, 0, 2])


def _untied_logits(b, depth, vocab, seed):
    return torch.randn(b, depth, vocab, generator=torch.Generator().manual_seed(seed)) * 2


@needs_port
def test_port_cpu_builder_equals_ours():
    """Its CPU builder (ddtree_utils.build_ddtree_tree: a heapq, ties in lexicographic rank-path order,
    as ours) from our top-k: node for node, also when every score ties."""
    module = peers._exec_file(PORT / peers.SGLANG_FILE, "_sglang_ddtree_utils", {}, stable_topk=False)
    cases = [(_untied_logits(3, 15, 3000, b), b) for b in (1, 8, 33)]
    cases += [(torch.zeros(2, 4, 6), b) for b in (1, 9, 40)]  # every score ties
    for logits, budget in cases:
        lp, ids = topk_stable(logits.log_softmax(-1), min(budget, logits.shape[-1]))
        want = build_tree(lp, ids, budget, impl="ref")
        out = module.build_ddtree_tree(
            None, budget, torch.device("cpu"), draft_top_log_probs=lp, draft_top_token_ids=ids
        )
        n = int(want.num_nodes.max())  # its padding: token and depth 0
        assert torch.equal(out[0][:, :n], want.tokens[:, :n]), budget
        assert torch.equal(out[1][:, :n], want.depths[:, :n]), budget
        assert torch.equal(out[2], want.parents), budget


@pytest.mark.gpu
@needs_port
def test_port_triton_builder_equals_ours_without_ties():
    """From the same top-k: the same nodes in the same (pop) order, visibility, input ids and positions.
    From logits (its torch.topk and float32 log Z): the same trees (token paths)."""
    make = peers.load_sglang_triton(PORT)
    for case in [(3, 15, 163840, 8), (4, 15, 163840, 32), (2, 15, 1000, 128), (5, 3, 50, 7)]:
        b, depth, vocab, budget = case
        logits = _untied_logits(b, depth, vocab, budget).cuda()
        roots = torch.arange(b, device="cuda") + 3
        starts = torch.arange(b, device="cuda") * 10 + 100
        port = make(b, depth, budget, logits.device)
        lp, ids = topk_stable(logits.log_softmax(-1), min(budget, vocab))
        tree = build_tree(lp, ids, budget)
        want = compile_tree(tree, roots, starts)
        port.from_topk(lp, ids, roots, starts)
        got = (port.tokens, port.depths, port.parents, port.visibility, port.input_ids, port.positions)
        ref = (tree.tokens, tree.depths, tree.parents, want.visibility, want.input_ids, want.positions)
        assert all(map(torch.equal, got, ref)), case
        port.from_logits(logits, roots, starts)
        tree = build_tree_from_logits(logits, budget)
        for r in range(b):
            ours = peers.token_paths(tree.tokens[r].tolist(), tree.parents[r].tolist())
            assert peers.token_paths(port.tokens[r].tolist(), port.parents[r].tolist()) == ours, case


@pytest.mark.gpu
@needs_port
def test_port_triton_builder_ties_pop_the_first_pushed():
    """Every score tied (L = 3, V = 4, budget 6): after the four depth-1 nodes, ours takes the
    lexicographically first rank paths (0, 0) and (0, 1), both under node 1; the port takes the
    candidates pushed first: the first children of nodes 1 and 2."""
    lp, ids = topk_stable(torch.zeros(1, 3, 4).log_softmax(-1), 4)
    port = peers.load_sglang_triton(PORT)(1, 3, 6, "cuda")
    port.build(lp.cuda(), ids.cuda())
    assert build_tree(lp, ids, 6, impl="ref").parents.tolist() == [[-1, 0, 0, 0, 0, 1, 1]]
    assert port.parents.tolist() == [[-1, 0, 0, 0, 0, 1, 2]]
