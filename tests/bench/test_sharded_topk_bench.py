"""`kdtree-engine bench sharded-topk`: the ranks' worker runs end to end (gloo on the CPU, 2 ranks, a tiny
vocabulary; NCCL on 2 GPUs where visible) and its checks hold at every point; the tie-aware id check
accepts what torch.topk may do with ties and nothing else; the port side's reproduction equals the
port's own worker method, bit for bit, run in threads standing in for ranks (when KDTREE_SGLANG_DDTREE
names a checkout holding ddtree_worker_v2.py; scripts/fetch_peers.sh extracts it); bad arguments are one
line and exit 2 at the CLI.

With KDTREE_SGLANG_DDTREE set the port's own builder is timed too (its CPU builder here)."""

from __future__ import annotations

import ast
import math
import os
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kdtree_engine.bench import sharded_topk as S
from kdtree_engine.cli import main
from tests.integrations.thread_group import ThreadGroup

WORKER_FILE = Path("python/sglang/srt/speculative/ddtree_worker_v2.py")
METHOD = "_compute_draft_topk_log_probs_and_token_ids"
RUNS = [("gloo", 2), pytest.param(("nccl", 2), marks=pytest.mark.gpu)]


def _port_path() -> str | None:
    return os.environ.get("KDTREE_SGLANG_DDTREE") or None


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_ranks_run_and_every_check_holds(run, tmp_path):
    backend, ranks = run
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        pytest.skip(f"NCCL on {ranks} ranks needs {ranks} GPUs")
    if not dist.is_available() or (backend == "gloo" and not dist.is_gloo_available()):
        pytest.skip(f"{backend} is not available in this torch build")
    sizes = {"batch": (1, 3), "budgets": (4, 16), "depth": 2, "vocab": 2048 * ranks, "iters": 1, "reps": 1}
    cfg = S.Config(ranks, backend, **sizes, seed=0, port=_port_path(), header="test")
    rows = S.run(cfg, tmp_path)
    assert [(r["batch"], r["budget"]) for r in rows] == [(1, 4), (1, 16), (3, 4), (3, 16)]
    for r in rows:
        assert S.passed(r) and r["rows"] == r["batch"] * cfg.depth, r
        assert r["max_abs_logprob_diff"] < 1e-4
        assert all(len(v) == ranks for v in r["per_rank_us"].values())
        for name in S.TIMES:
            assert r[name] == max(r["per_rank_us"][name]) or math.isnan(r[name])
            assert r[name] > 0 or (name == "port build" and cfg.port is None)
    text = (tmp_path / "sharded_topk.md").read_text()
    assert text.startswith("test\n") and text.count("| yes | yes |") == 4


def test_tie_check_accepts_tie_order_and_choice_only():
    """Row 0: a tie inside the top-k (ids 3, 5) and at the k-th place (ids 1, 7 for one place)."""
    logits = torch.tensor([[0.0, 2.0, 0.0, 5.0, 0.0, 5.0, 9.0, 2.0]])
    ours = torch.tensor([[6, 3, 5, 1]])
    ok = S.same_up_to_ties(logits, torch.tensor([[6, 5, 3, 7]]), ours)
    assert ok["values"] and ok["above_kth"] and ok["in_order"] == 0
    assert S.same_up_to_ties(logits, ours, ours)["in_order"] == 1
    wrong_value = S.same_up_to_ties(logits, torch.tensor([[6, 5, 3, 0]]), ours)
    assert not wrong_value["values"]
    out_of_order = S.same_up_to_ties(logits, torch.tensor([[3, 6, 5, 1]]), ours)
    assert not out_of_order["values"]


# ---- the port side against the port's own method ---------------------------------------------------


def port_method(group):
    """DDTreeWorkerV2's draft top-k method compiled alone from the checkout's worker file (the rest of
    the file imports SGLang's scheduler), with `get_tp_group` returning `group`."""
    path = _port_path()
    source = Path(path or "") / WORKER_FILE
    if not path or not source.is_file():
        pytest.skip(f"KDTREE_SGLANG_DDTREE does not name a checkout holding {WORKER_FILE}")
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DDTreeWorkerV2")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == METHOD)
    namespace = {"torch": torch, "get_tp_group": lambda: group}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(source), "exec"), namespace)
    return namespace[METHOD]


def lm_head(logits: torch.Tensor, start: int) -> types.SimpleNamespace:
    """An lm_head shard whose weight against identity hidden states gives `logits` [T, Vs] exactly."""
    size = logits.shape[1]
    shard = types.SimpleNamespace(
        num_org_elements=size,
        num_org_elements_padded=size,
        num_added_elements=0,
        org_vocab_start_index=start,
        added_vocab_start_index=0,
    )
    return types.SimpleNamespace(shard_indices=shard, weight=logits.t().contiguous())


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("topk", [1, 16, 40])
def test_port_side_is_the_port_method(world, topk):
    group = ThreadGroup(world)
    method = port_method(group)
    t, shard = 6, 32
    gen = torch.Generator().manual_seed(world * 100 + topk)
    logits = (torch.randn(t, world * shard, generator=gen) * 3).bfloat16()  # bf16: ties across shards
    results = [None] * (2 * world)

    def rank(r: int) -> None:
        group.local.rank = r
        part, start = logits[:, r * shard : (r + 1) * shard].contiguous(), r * shard
        hidden = torch.eye(t, dtype=torch.bfloat16)
        self = types.SimpleNamespace(_ddtree_vocab_id_cache_key=None)
        results[r] = method(self, hidden, lm_head(part, start), topk)
        id_map = torch.arange(shard) + start
        results[world + r] = S.port_draft_topk(part, id_map, topk, group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r in range(world):
        (want_lp, want_ids), (got_lp, got_ids) = results[r], results[world + r]
        assert torch.equal(got_ids, want_ids) and torch.equal(got_lp, want_lp), f"rank {r}/{world}"


# ---- the CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ranks", "0"], "--ranks: expected >= 1, got 0"),
        (["--batch", "1", "0"], "--batch: expected >= 1, got 0"),
        (["--budgets", "4097"], "--budgets: expected 1..4096, got 4097"),
        (["--depth", "0"], "--depth: expected >= 1, got 0"),
        (["--iters", "0"], "--iters: expected >= 1, got 0"),
        (["--ranks", "2", "--vocab", "6144"], "--vocab: expected a multiple of 2048 * ranks = 4096"),
        (["--ranks", "3", "--backend", "gloo"], "--vocab: expected a multiple of 2048 * ranks = 6144"),
        (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, message):
    rc, err = _run(capsys, *argv)
    assert rc == 2 and message in err, err


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer GPUs than ranks")
def test_nccl_with_too_few_gpus_names_ranks(capsys):
    rc, err = _run(capsys, "--backend", "nccl", "--ranks", "64", "--vocab", str(2048 * 64))
    assert (
        rc == 2
        and f"--ranks: --backend nccl runs one rank per GPU: 64 ranks, {torch.cuda.device_count()}" in err
    )


def test_missing_port_names_port(capsys, tmp_path):
    rc, err = _run(capsys, "--backend", "gloo", "--ranks", "2", "--vocab", "4096", "--port", str(tmp_path))
    assert (
        rc == 2
        and err.startswith("kdtree-engine bench sharded-topk: --port: no python/sglang/")
        and str(tmp_path) in err
    )


def _run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(["bench", "sharded-topk", *argv])
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return rc, err
