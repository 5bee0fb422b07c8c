"""The rank side of test_sharded_topk_processes: one process per tensor-parallel rank, as SGLang runs
them. Each rank holds its shard of a vocab-parallel lm_head (SGLang's shard layout: the vocabulary
padded to a multiple of 64, split evenly, the last rank's padding rows zero), runs the drop-in's worker
method (its tensor-parallel group: a torch.distributed process group behind TorchGroup), reshapes the
top-k as the worker does and builds the tree into the port's buffers. Every case's outputs go to
<out_dir>/rank<r>.pt for the parent to compare with one rank's.

The draft logits are designed (ties, plateaus) and reach the method through hidden states that are
the identity: logits = I @ X^T = X exactly, in bf16 on any device, since every X is a bf16 value.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kdtree_engine.bench.peers import port_tree_buffers
from kdtree_engine.integrations.sglang import build as B
from kdtree_engine.integrations.sglang import topk as T
from kdtree_engine.integrations.sharded_topk import TorchGroup

VOCAB = 8 * 2048 - 2  # padded to 16384: shards of 8192, 4096, 2048 on 2, 4, 8 ranks, the last one ragged
PADDED = 8 * 2048


@dataclass(frozen=True)
class Case:
    bs: int
    depth: int  # L, the draft positions per request
    topk: int
    budget: int


CASES = {
    "random_bf16": Case(2, 3, 8, 16),
    "all_equal_rows": Case(2, 2, 8, 12),
    "kth_place_tie": Case(1, 3, 8, 16),
    "shard_boundary_ties": Case(2, 2, 32, 32),
    "three_levels": Case(3, 2, 5, 9),
    "top1_ties": Case(2, 4, 1, 4),
}


def _boundaries() -> list[int]:
    """The first id of every shard on 2, 4 and 8 ranks (multiples of 2048), past id 0."""
    return list(range(2048, VOCAB, 2048))


def case_logits(name: str) -> torch.Tensor:
    """The draft logits of case `name`: [bs, L, VOCAB] float32, every value a bf16 value."""
    c = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shape = (c.bs, c.depth, VOCAB)
    x = torch.randn(shape, generator=g) * 3
    if name == "all_equal_rows":  # the whole row one plateau: ids 0..k-1, each -log V
        x = torch.arange(c.bs * c.depth, dtype=torch.float32).reshape(c.bs, c.depth, 1) / 4 - 1
        x = x.expand(shape).clone()
    elif name == "kth_place_tie":  # k - 3 clear winners, then one value at more ids than places left
        x = -torch.rand(shape, generator=g) - 1
        x[..., [5000, 9000, 15000, 300, 12287]] = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0])
        ends = [0, 2047, 2048, 4095, 4096, 6143, 6144, 8191, 8192, 10240, 14335, 14336, VOCAB - 1]
        x[0, 0, ends] = 4.0  # 13 ids in every shard for 3 places: ids 0, 2047, 2048
        x[0, 1, ends + [5000, 9000]] = 4.0  # for 5 places: 0, 2047, 2048, 4095, 4096
        x[0, 2, [VOCAB - 1, 14336, 14335, 10240, 8192]] = 4.0  # in the later shards: 8192, 10240, 14335
    elif name == "shard_boundary_ties":  # equal maxima on both sides of every shard boundary
        for i, b in enumerate(_boundaries()):
            x[..., [b - 1, b]] = 12.0 - (i % 3)
        x[..., [0, VOCAB - 1]] = 12.0
        x[1, 0] = 0.0
        x[1, 0, _boundaries()] = 1.0  # first ids of shards 1.. tie at the top, behind nothing
    elif name == "three_levels":  # values 0, 1, 2: thousands of ties in every shard
        x = torch.randint(0, 3, shape, generator=g).float()
    elif name == "top1_ties":  # k = 1: the max sits in a later shard, tied with later ones still
        x = -torch.rand(shape, generator=g)
        x[..., [VOCAB - 1, 14336, 6144]] = 2.0
        x[0, 0, 2047] = 2.0
    return x.to(torch.bfloat16).float()


def lm_head_shard(x: torch.Tensor, rank: int, world: int, device) -> types.SimpleNamespace:
    """SGLang's vocab-parallel lm_head on `rank` for draft logits x [bs, L, V] and identity hidden
    states: weight [PADDED / world, bs * L] bf16, rows past the real vocabulary zero (its padding)."""
    size = PADDED // world
    start, org = rank * size, max(0, min(size, VOCAB - rank * size))
    w = torch.zeros(size, x.shape[0] * x.shape[1], dtype=torch.bfloat16)
    w[:org] = x.reshape(-1, VOCAB)[:, start : start + org].t().to(torch.bfloat16)
    shard = types.SimpleNamespace(
        org_vocab_start_index=start,
        num_org_elements=org,
        num_org_elements_padded=size,
        num_added_elements=0,
    )
    return types.SimpleNamespace(shard_indices=shard, weight=w.to(device))


@contextlib.contextmanager
def tp_group(group):
    """sglang.srt.distributed.get_tp_group, where the worker method reads its group, returning `group`
    (a stand-in module where SGLang is not installed); restored on exit."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("sglang", "sglang.srt", "sglang.srt.distributed"):
            patch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
        patch.setattr(sys.modules["sglang.srt.distributed"], "get_tp_group", lambda: group, raising=False)
        yield


def drop_in(name: str, lm_head, device) -> dict[str, torch.Tensor]:
    """The worker's draft top-k then the tree build, as the drop-in runs them -> CPU tensors."""
    c = CASES[name]
    hidden = torch.eye(c.bs * c.depth, dtype=torch.bfloat16, device=device)  # [T, H = T]
    lp, ids = T.compute_draft_topk_log_probs_and_token_ids(None, hidden, lm_head, c.topk)
    lp, ids = lp.view(c.bs, c.depth, c.topk), ids.view(c.bs, c.depth, c.topk)
    bufs = port_tree_buffers(c.bs, c.budget, device)
    tokens, depths, parents, _, vis, sizes, _ = B.build_ddtree_tree_gpu(
        draft_top_log_probs=lp, draft_top_token_ids=ids, tree_budget=c.budget, device=lp.device, **bufs
    )
    out = {"lp": lp, "ids": ids, "tokens": tokens, "depths": depths, "parents": parents}
    out.update(visibility=vis, sizes=sizes)
    return {k: v.cpu() for k, v in out.items()}


def rank_main(rank: int, world: int, backend: str, store: str, out_dir: str) -> None:
    """One tensor-parallel rank (torch.multiprocessing.spawn's entry): every case, then its outputs."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        tp = dist.new_group(list(range(world)))  # SGLang's tensor-parallel group is a group of its own
        with tp_group(TorchGroup(tp)):
            got = {n: drop_in(n, lm_head_shard(case_logits(n), rank, world, device), device) for n in CASES}
        torch.save(got, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
