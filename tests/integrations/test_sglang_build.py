"""build_ddtree_tree_gpu (the SGLang port's signature): kernels == reference, == the port's own CPU
builder (the official heap), and beside the port's GPU builder, which differs only on ties."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.bench.peers import port_tree_buffers as port_buffers  # the port worker's buffers
from kdtree_engine.integrations.sglang import build as B
from kdtree_engine.ref import tree as ref_tree

from .port import port_triton, port_utils


def topk_inputs(seed: int, bs: int, depth: int, budget: int, vocab: int = 24, ties: bool = True):
    """Sorted top-k log-probs and ids [bs, depth, min(budget, vocab)]; rounded logits tie often."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, depth, vocab, generator=g) * 2
    x = torch.round(x) if ties else x
    return ref_tree.logits_to_topk(x, max(1, min(budget, vocab)))


def run(lp, ids, budget, bufs, fn=B.build_ddtree_tree_gpu):
    return fn(draft_top_log_probs=lp, draft_top_token_ids=ids, tree_budget=budget, device=lp.device, **bufs)


OUTS = (
    "_out_node_token_ids",
    "_out_node_depths",
    "_out_parents",
    "_out_visibility",
    "_out_actual_tree_sizes",
)
CASES = [(1, 1, 1), (3, 4, 7), (2, 15, 16), (2, 6, 33), (5, 3, 8), (2, 4, 0), (1, 16, 64)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_equal_reference(case, device):
    bs, depth, budget = case
    lp, ids = topk_inputs(sum(case), bs, depth, budget)
    want = port_buffers(bs + 2, budget)
    run(lp, ids, budget, want)
    got = port_buffers(bs + 2, budget, device)
    outs = {"tokens": got["_out_node_token_ids"], "depths": got["_out_node_depths"],
            "parents": got["_out_parents"], "visibility": got["_out_visibility"],
            "sizes": got["_out_actual_tree_sizes"]}  # fmt: skip
    B.build_with_kernels(lp.to(device), ids.to(device), budget, outs)
    for name in OUTS:
        assert torch.equal(got[name].cpu(), want[name]), name  # rows past bs untouched on both sides


def test_reference_layout_by_hand():
    """Two depths, two candidates each: log-probs make the pops root->a, a->c, root->b."""
    lp = torch.log(torch.tensor([[[0.6, 0.3], [0.7, 0.2]]]))
    ids = torch.tensor([[[5, 6], [7, 8]]])
    bufs = port_buffers(1, 3)
    tokens, depths, parents, maps, vis, sizes, sizes_cpu = run(lp, ids, 3, bufs)
    assert tokens.tolist() == [[5, 7, 6]] and depths.tolist() == [[1, 2, 1]]
    assert parents.tolist() == [[-1, 0, 1, 0]] and maps == [] and sizes.tolist() == [4] and sizes_cpu == [4]
    want = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert vis.long().tolist() == [want]


def test_masked_tokens_make_a_short_tree(device):
    """-inf log-probs never enter the tree: sizes count real nodes, the rest stays padding."""
    lp = torch.tensor([[[-0.1, float("-inf")], [-0.2, float("-inf")]]])
    ids = torch.tensor([[[3, 4], [5, 6]]])
    bufs = port_buffers(1, 4)
    run(lp, ids, 4, bufs)
    assert bufs["_out_actual_tree_sizes"].tolist() == [3]
    assert bufs["_out_node_token_ids"].tolist() == [[3, 5, 0, 0]]
    assert bufs["_out_parents"].tolist() == [[-1, 0, 1, -1, -1]]
    assert not bufs["_out_visibility"][0, 3:].any()


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda a: a.update(draft_top_log_probs=a["draft_top_log_probs"][0]), "draft_top_log_probs"),
        (lambda a: a.update(draft_top_token_ids=a["draft_top_token_ids"].float()), "draft_top_token_ids"),
        (lambda a: a.update(tree_budget=-1), "tree_budget"),
        (lambda a: a.update(tree_budget=4097), r"tree_budget: expected an int in \[0, 4096\]"),
        (lambda a: a.update(_out_parents=a["_out_parents"][:, :3]), "_out_parents"),
        (lambda a: a.update(_out_visibility=a["_out_visibility"].long()), "_out_visibility"),
        (
            lambda a: a.update(_out_actual_tree_sizes=a["_out_actual_tree_sizes"][:1]),
            "_out_actual_tree_sizes",
        ),
    ],
)
def test_bad_arguments_are_named(change, name):
    lp, ids = topk_inputs(0, 2, 3, 5)
    args = dict(draft_top_log_probs=lp, draft_top_token_ids=ids, tree_budget=5, device=lp.device,
                **port_buffers(2, 5))  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=name):
        B.build_ddtree_tree_gpu(**args)


def test_prune_needs_sglang():
    lp, ids = topk_inputs(0, 1, 3, 4)
    with pytest.raises(ValueError, match="prune_to_deepest_chains"):
        run(lp, ids, 4, dict(port_buffers(1, 4), prune_to_deepest_chains=True))


@pytest.mark.parametrize("seed", range(6))
def test_equal_to_the_ports_cpu_builder(seed):
    """The port's Python builder is the official heap: equal tensor by tensor, ties included."""
    port = port_utils()
    bs, depth, budget = 3, 6, [5, 16, 31, 40, 64, 9][seed]
    lp, ids = topk_inputs(seed, bs, depth, budget, vocab=40)
    want = port.build_ddtree_tree(None, budget, torch.device("cpu"), draft_top_log_probs=lp,
                                  draft_top_token_ids=ids)  # fmt: skip
    got = run(lp, ids, budget, port_buffers(bs, budget))
    for i in (0, 1, 2, 4, 5):
        assert torch.equal(got[i], want[i].to(got[i].dtype)), i
    assert got[6] == want[6]


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True])
def test_beside_the_ports_gpu_builder(ties):
    """Without ties the port's Triton builder gives our trees; with ties ours stay the official ones."""
    triton_port, utils = port_triton(), port_utils()
    bs, depth, budget, dev = 16, 15, 32, torch.device("cuda")
    lp, ids = topk_inputs(7, bs, depth, budget, vocab=4096 if not ties else 12, ties=ties)
    ours = run(lp.to(dev), ids.to(dev), budget, port_buffers(bs, budget, dev))
    theirs = port_buffers(bs, budget, dev)
    triton_port.build_ddtree_tree_triton(
        top_log_probs=lp.to(dev), top_token_ids=ids.to(dev), tree_budget=budget,
        **{k.lstrip("_"): v for k, v in theirs.items()},
    )  # fmt: skip
    official = utils.build_ddtree_tree(None, budget, torch.device("cpu"), draft_top_log_probs=lp,
                                       draft_top_token_ids=ids)  # fmt: skip
    for i in (0, 1, 2, 4, 5):
        assert torch.equal(ours[i].cpu(), official[i].to(ours[i].dtype)), i
    if not ties:  # the port's builder is exact here: its tensors equal ours
        for i, name in enumerate(OUTS):
            assert torch.equal(theirs[name].cpu(), ours[i if i < 3 else i + 1].cpu()), name
