"""The drop-in's tensor-parallel draft top-k across processes, as SGLang runs it: one process per rank
(torch.multiprocessing spawn), a torch.distributed process group, each rank holding its vocabulary
shard of the lm_head, the all-gathers on that group, then the merge and the tree build. Every rank's
top-k and tree equal one rank's, bit for bit, ties and plateaus included (sharded_ranks.CASES).

gloo on the CPU with 2 and 4 ranks; NCCL with 2, 4 and 8 ranks where that many GPUs are visible. One
spawn per backend and rank count runs every case (a spawn costs seconds, a case milliseconds).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdtree_engine.integrations.sharded_topk import TorchGroup
from kdtree_engine.ref import tree as ref_tree

from . import sharded_ranks as R

# the NCCL runs carry the gpu mark, so that the GPU checks (`pytest -m "gpu or golden"`) select them
RUNS = [("gloo", 2), ("gloo", 4)] + [pytest.param(("nccl", w), marks=pytest.mark.gpu) for w in (2, 4, 8)]


def _skip_reason(backend: str, world: int) -> str | None:
    if not dist.is_available():
        return "torch.distributed is not available in this build"
    if backend == "gloo" and not dist.is_gloo_available():
        return "gloo is not available in this torch build"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "NCCL is not available in this torch build (CPU-only torch)"
        if torch.cuda.device_count() < world:
            return f"NCCL on {world} ranks needs {world} GPUs, {torch.cuda.device_count()} visible"
    return None


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"{r[0]}-{r[1]}")
def ranks(request, tmp_path_factory) -> list[dict]:
    """Every rank's outputs (rank order) of one spawn: {case: {name: tensor}}."""
    backend, world = request.param
    reason = _skip_reason(backend, world)
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp(f"{backend}{world}")
    mp.spawn(R.rank_main, args=(world, backend, str(out / "store"), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def one_rank() -> dict:
    """The drop-in on one rank holding the whole vocabulary, the spec the ranks must equal."""
    cpu = torch.device("cpu")
    with R.tp_group(types.SimpleNamespace(world_size=1)):
        return {n: R.drop_in(n, R.lm_head_shard(R.case_logits(n), 0, 1, cpu), cpu) for n in R.CASES}


@pytest.mark.parametrize("case", list(R.CASES))
def test_ranks_equal_one_rank(ranks, one_rank, case):
    want = one_rank[case]
    for rank, got in enumerate(ranks):
        for name, tensor in want.items():
            assert torch.equal(got[case][name], tensor), f"rank {rank}/{len(ranks)}: {name} differs"


@pytest.mark.parametrize("case", list(R.CASES))
def test_one_rank_is_logits_to_topk(one_rank, case):
    """The identity hidden states carry the designed logits exactly: one rank's top-k is logits_to_topk
    of them; every tree is full (budget + 1 nodes), so the trees compared above are not trivial."""
    c = R.CASES[case]
    want_lp, want_ids = ref_tree.logits_to_topk(R.case_logits(case), c.topk)
    assert torch.equal(one_rank[case]["lp"], want_lp) and torch.equal(one_rank[case]["ids"], want_ids)
    assert (one_rank[case]["sizes"] == c.budget + 1).all()


def test_torch_group_gathers_and_checks_its_output():
    """TorchGroup on a one-process gloo group: the gather in rank order, a wrong output refused."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group, x = TorchGroup(), torch.arange(6).reshape(2, 3)
        out = x.new_empty((1, 2, 3))
        group.all_gather_into_tensor(out, x)
        assert group.world_size == 1 and torch.equal(out[0], x)
        with pytest.raises(ValueError, match="out"):
            group.all_gather_into_tensor(x.new_empty((2, 2, 3)), x)
        with pytest.raises(ValueError, match="out"):
            group.all_gather_into_tensor(x.new_empty((3, 2)).t(), x)
    finally:
        dist.destroy_process_group()
