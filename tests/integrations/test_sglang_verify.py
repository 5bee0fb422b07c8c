"""compile_ddtree_tree and follow_verified_tree_gpu (the SGLang port's signatures): the kernels (run on
the CPU through the Triton interpreter when there is no GPU) equal the reference on random trees in the
port's buffers; the reference equals hand-written results on a small tree and, when KDTREE_SGLANG_DDTREE
names a checkout, the port's own CPU functions."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.integrations.sglang import verify as V
from kdtree_engine.ref import sglang_verify as ref

from .port import port_utils

CPU = torch.device("cpu")


def random_trees(g: torch.Generator, bs: int, q: int, sizes: list[int], vocab: int) -> dict:
    """bs trees in q verify slots: real slots < sizes[b] form a tree (parents[i] < i, tokens from a
    small vocab so siblings often share one), ancestor visibility in the real rows; every padding slot,
    and the real rows' columns past the tree, hold garbage the functions must not read."""
    tokens = torch.randint(0, vocab, (bs, q), generator=g)
    parents = torch.randint(-1, q, (bs, q), generator=g)  # garbage in the padding slots
    depths = torch.randint(0, 9, (bs, q), generator=g)
    vis = torch.rand(bs, q, q, generator=g) < 0.5
    for b, size in enumerate(sizes):
        parents[b, 0], depths[b, 0] = -1, 0
        vis[b, :size, :size] = False
        for i in range(size):
            if i:
                parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
                depths[b, i] = depths[b, parents[b, i]] + 1
                vis[b, i, :size] = vis[b, parents[b, i], :size]
            vis[b, i, i] = True
    return dict(tokens=tokens, parents=parents, depths=depths, vis=vis)


def path_targets(trees: dict, sizes: list[int], g: torch.Generator, vocab: int) -> torch.Tensor:
    """Targets [bs, q] that lead down to a random real node (then a random token): long accepted paths."""
    parents, tokens = trees["parents"], trees["tokens"]
    target = torch.randint(0, vocab, tuple(tokens.shape), generator=g)
    for b, size in enumerate(sizes):
        node = int(torch.randint(0, max(size, 1), (1,), generator=g))
        while node > 0:
            parent = int(parents[b, node])
            target[b, parent] = tokens[b, node]
            node = parent
    return target


def port_buffers(g: torch.Generator, trees: dict, max_bs: int, budget: int, device) -> dict:
    """The trees written into the port worker's buffers (node i at column i - 1 of [max_bs, budget]
    node buffers; visibility [max_bs, budget + 1, budget + 1]); the rows past bs and the slots past q
    hold garbage."""
    bs, q = trees["tokens"].shape
    n = budget + 1
    nodes = torch.randint(0, 50, (max_bs, budget), generator=g)
    depths = torch.randint(0, 50, (max_bs, budget), generator=g)
    vis = torch.rand(max_bs, n, n, generator=g) < 0.5
    nodes[:bs, : q - 1] = trees["tokens"][:, 1:]
    depths[:bs, : q - 1] = trees["depths"][:, 1:]
    vis[:bs, :q, :q] = trees["vis"]
    return {k: v.to(device) for k, v in dict(nodes=nodes, depths=depths, vis=vis).items()}


def compile_both(case, device, build_mask: bool, strided: bool = False):
    """One compile on the reference (CPU, through the public function) and one on the kernels (device),
    from identical port buffers and oversized, garbage-filled output buffers; returns both sides'
    outputs and every buffer they may have written, for a whole-buffer comparison."""
    bs, q, budget, max_bs, sizes, pasts = case
    g = torch.Generator().manual_seed(1000 * bs + 10 * q + sum(sizes) + sum(pasts))
    trees = random_trees(g, bs, q, sizes, vocab=50)
    bufs = port_buffers(g, trees, max_bs, budget, CPU)
    roots = trees["tokens"][:, 0].clone()
    starts = torch.randint(0, 4000, (max_bs,), generator=g)
    size_t = torch.tensor(sizes + [0] * (max_bs - bs))
    past_t = torch.tensor(pasts + [0] * (max_bs - bs))
    mask_numel = sum(q * (p + q) for p in pasts)
    outs = dict(
        ids=torch.randint(0, 9, (max_bs * (budget + 1) + 3,), generator=g),
        pos=torch.randint(0, 9, (max_bs * (budget + 1) + 3,), generator=g),
        mask=torch.rand(mask_numel + 37, generator=g) < 0.5,
    )
    results = []
    for dev, use_kernels in ((CPU, False), (device, True)):
        b = {k: v.clone().to(dev) for k, v in bufs.items()}
        o = {k: v.clone().to(dev) for k, v in outs.items()}
        nodes, depths = b["nodes"][:bs], b["depths"][:bs]
        if strided:  # a column stride of 2 and a transposed visibility
            nodes = torch.repeat_interleave(nodes, 2, dim=1)[:, ::2]
            b["vis"] = b["vis"].transpose(1, 2).contiguous().transpose(1, 2)
        args = (
            roots.to(dev),
            nodes,
            depths,
            b["vis"][:bs],
            starts.to(dev),
            past_t.to(dev),
            budget,
            size_t.to(dev),
            dev,
            pasts,
            None,
            q,
            build_mask,
            o["ids"],
            o["pos"],
            o["mask"],
        )
        if use_kernels:
            got = V._compile(*args, use_kernels=True)
        else:
            got = V.compile_ddtree_tree(*args)
        results.append(
            ([x if x is None else x.cpu() for x in got], {k: v.cpu() for k, v in {**b, **o}.items()})
        )
    return results


# (bs, q, budget, max_bs, actual sizes, past lengths)
CASES = [
    (1, 1, 0, 2, [1], [0]),
    (1, 2, 1, 1, [2], [5]),
    (2, 2, 3, 3, [1, 2], [0, 3]),
    (3, 7, 6, 4, [7, 3, 1], [0, 11, 2]),
    (2, 5, 8, 3, [5, 4], [9, 0]),  # a verify bucket smaller than budget + 1
    (4, 13, 12, 6, [13, 1, 8, 12], [1, 0, 40, 17]),
    (2, 33, 40, 2, [33, 20], [64, 3]),
    (2, 3, 4, 2, [3, 2], [1500, 2]),  # a row longer than one kv block
]


@pytest.mark.parametrize("build_mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-q{c[1]}-budget{c[2]}")
def test_compile_kernels_equal_reference(case, build_mask, device):
    (want, want_bufs), (got, got_bufs) = compile_both(case, device, build_mask)
    assert (got[2] is None) == (want[2] is None) == (not build_mask)
    for i, (a, w) in enumerate(zip(got, want)):
        assert a is None or torch.equal(a, w), i
    for k in want_bufs:  # visibility, node buffers and every output buffer, rows past bs included
        assert torch.equal(got_bufs[k], want_bufs[k]), k


@pytest.mark.parametrize("build_mask", [True, False], ids=["mask", "no-mask"])
def test_compile_kernels_strided_views(build_mask, device):
    case = CASES[5]
    (want, want_bufs), (got, got_bufs) = compile_both(case, device, build_mask, strided=True)
    (plain, _), _ = compile_both(case, device, build_mask)
    for a, w, p in zip(got, want, plain):
        assert a is None or (torch.equal(a, w) and torch.equal(w, p))
    assert torch.equal(got_bufs["vis"], want_bufs["vis"])


def follow_case(case, device, targets: str):
    """Trees in [bs, q] (views with strides) with targets following long paths or random; outputs into
    oversized buffers filled with a sentinel. Returns (reference buffers, kernel buffers, returned)."""
    bs, q, sizes, max_bs, width = case
    g = torch.Generator().manual_seed(1000 * bs + 10 * q + sum(sizes) + len(targets))
    trees = random_trees(g, bs, q, sizes, vocab=3)
    target = (
        path_targets(trees, sizes, g, 3) if targets == "path" else torch.randint(0, 3, (bs, q), generator=g)
    )
    ins = dict(
        draft_tokens=torch.repeat_interleave(trees["tokens"], 2, dim=1)[:, ::2],  # column stride 2
        target_predict=target.t().contiguous().t(),  # column-major
        parents=trees["parents"],
        actual_tree_sizes=torch.tensor(sizes + [7] * (max_bs - bs)),
    )
    outs = dict(
        accepted_indices=torch.full((max_bs, width), 777),
        accepted_token_ids=torch.full((max_bs, width), 777),
        accepted_lens=torch.full((max_bs,), 777),
        next_tokens=torch.full((max_bs,), 777),
    )
    want_outs = {k: v.clone() for k, v in outs.items()}
    want = V.follow_verified_tree_gpu(**ins, **want_outs)
    got_outs = {k: v.to(device) for k, v in outs.items()}
    dev_ins = [ins[k].to(device) for k in ("draft_tokens", "target_predict", "parents", "actual_tree_sizes")]
    got = V._follow(*dev_ins, *got_outs.values(), use_kernels=True)
    for w, o in zip(want, want_outs.values()):  # the returned tensors are views of the caller's buffers
        assert w.data_ptr() == o.data_ptr()
    return want_outs, {k: v.cpu() for k, v in got_outs.items()}, [x.cpu() for x in got], want


# (bs, q, actual sizes, max_bs, output width)
FOLLOW = [
    (1, 1, [1], 1, 1),
    (1, 2, [2], 2, 3),
    (3, 5, [5, 1, 3], 3, 5),
    (2, 7, [7, 0], 4, 9),  # size 0 acts as 1 (the root only)
    (4, 12, [12, 9, 12, 5], 5, 12),
    (2, 33, [33, 30], 2, 41),
]


@pytest.mark.parametrize("targets", ["path", "random"])
@pytest.mark.parametrize("case", FOLLOW, ids=lambda c: f"bs{c[0]}-q{c[1]}")
def test_follow_kernel_equals_reference(case, targets, device):
    want_bufs, got_bufs, got, want = follow_case(case, device, targets)
    for k in want_bufs:  # sentinels past [:bs, :q] stay on both sides
        assert torch.equal(got_bufs[k], want_bufs[k]), k
    for a, w in zip(got, want):
        assert torch.equal(a, w)
    bs, q = case[0], case[1]
    assert (want_bufs["accepted_indices"][bs:] == 777).all() and (
        want_bufs["accepted_indices"][:, q:] == 777
    ).all()
    assert (want[2] >= 1).all()


def test_follow_paths_get_long(device):
    """The path targets do reach deep nodes (so the kernel test compares real walks, not root stops)."""
    lens = follow_case((4, 12, [12, 9, 12, 5], 5, 12), device, "path")[3][2]
    assert lens.max() >= 3


def test_follow_default_sizes_and_fresh_outputs(device):
    g = torch.Generator().manual_seed(3)
    trees = random_trees(g, 3, 6, [6, 6, 6], vocab=2)
    target = path_targets(trees, [6, 6, 6], g, 2)
    ins = dict(draft_tokens=trees["tokens"], target_predict=target, parents=trees["parents"])
    want = V.follow_verified_tree_gpu(**ins)
    got = V._follow(*(v.to(device) for v in ins.values()), None, None, None, None, None, use_kernels=True)
    for a, w in zip(got, want):
        assert a.dtype == w.dtype == torch.long and torch.equal(a.cpu(), w)


# One 5-node tree (slots 0-4 real, slot 5 padding): 0 -> {1, 2}, 1 -> 3 -> 4; nodes 1 and 2 are both
# drafted with token 11, so the path follower must pick the lower-numbered one.
HAND = dict(
    root=10,
    tokens=[11, 11, 13, 14, 0],  # node i at column i - 1; column 4 is slot 5 (padding)
    depths=[1, 1, 2, 3, 0],
    parents=[-1, 0, 0, 1, 3, -1],
    start=20,
    past=3,
)
HAND_VIS = [  # ancestor-or-self rows; row 5 (padding) is garbage
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 1, 0, 1, 1, 0],
    [1, 1, 1, 1, 1, 1],
]


def hand_compile(build_mask: bool):
    vis = torch.tensor([HAND_VIS], dtype=torch.bool)
    out = V.compile_ddtree_tree(
        torch.tensor([HAND["root"]]),
        torch.tensor([HAND["tokens"]]),
        torch.tensor([HAND["depths"]]),
        vis,
        torch.tensor([HAND["start"]]),
        torch.tensor([HAND["past"]]),
        5,
        torch.tensor([5]),
        CPU,
        build_attention_mask=build_mask,
    )
    return out, vis


def test_reference_hand_tree_no_mask():
    (ids, pos, mask, sizes), vis = hand_compile(False)
    assert ids.tolist() == [[10, 11, 11, 13, 14, 0]]
    assert pos.tolist() == [[20, 21, 21, 22, 23, 20]]  # start + depth; the padding slot's depth is 0
    assert mask is None and sizes.tolist() == [5]
    assert vis.int().tolist() == [HAND_VIS[:5] + [[0, 0, 0, 0, 0, 1]]]  # padding row -> self only


def test_reference_hand_tree_mask():
    (ids, pos, mask, _), vis = hand_compile(True)
    assert ids.tolist() == [[10, 11, 11, 13, 14, 0]] and pos.tolist() == [[20, 21, 21, 22, 23, 20]]
    want = [
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1],  # padding: only its own slot
    ]
    assert mask.shape == (6 * 9,) and mask.view(6, 9).int().tolist() == want
    assert vis.int().tolist() == [HAND_VIS]  # untouched with the mask


def test_reference_hand_tree_follow(device):
    draft = torch.tensor([[10, 11, 11, 13, 14, 0]] * 3)
    parents = torch.tensor([HAND["parents"]] * 3)
    target = torch.tensor(
        [
            [11, 13, 55, 14, 42, 0],  # 0 -> 1 (not 2) -> 3 -> 4, then 42
            [11, 13, 55, 14, 42, 0],  # the same, but node 4 is padding (size 4): stops at 3
            [12, 13, 55, 14, 42, 0],  # no child of the root is drafted with 12
        ]
    )
    idx, tok, lens, nxt = V.follow_verified_tree_gpu(
        draft_tokens=draft, target_predict=target, parents=parents, actual_tree_sizes=torch.tensor([5, 4, 5])
    )
    assert idx.tolist() == [[0, 1, 3, 4, -1, -1], [0, 1, 3, -1, -1, -1], [0, -1, -1, -1, -1, -1]]
    assert tok.tolist() == [[10, 11, 13, 14, 0, 0], [10, 11, 13, 0, 0, 0], [10, 0, 0, 0, 0, 0]]
    assert lens.tolist() == [4, 3, 1] and nxt.tolist() == [42, 14, 12]
    ins = (draft, target, parents, torch.tensor([5, 4, 5]))
    got = V._follow(*(t.to(device) for t in ins), None, None, None, None, use_kernels=True)
    for a, w in zip(got, (idx, tok, lens, nxt)):
        assert torch.equal(a.cpu(), w)


def compile_kwargs(**over):
    """Arguments of a valid compile of 2 trees in 4 slots (budget 3), with `over` replacing some."""
    kw = dict(
        root_token_ids=torch.tensor([1, 2]),
        node_token_ids=torch.zeros(2, 3, dtype=torch.long),
        node_depths=torch.ones(2, 3, dtype=torch.long),
        visibility=torch.eye(4, dtype=torch.bool).repeat(2, 1, 1),
        start_positions=torch.tensor([5, 6]),
        past_lengths=torch.tensor([2, 0]),
        tree_budget=3,
        actual_tree_sizes=torch.tensor([4, 2]),
        device=CPU,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, name",
    [
        (dict(verify_token_num=0), "verify_token_num"),
        (
            dict(verify_token_num=3, actual_tree_sizes=torch.tensor([3, 3]), actual_sizes_cpu=[4, 2]),
            "verify_token_num",
        ),
        (dict(verify_token_num=3), "verify_token_num"),  # on the CPU the sizes are read from the tensor
        (dict(_out_verify_input_ids=torch.zeros(7, dtype=torch.long)), "_out_verify_input_ids"),
        (dict(_out_verify_position_ids=torch.zeros(7, dtype=torch.long)), "_out_verify_position_ids"),
        (dict(_out_attention_mask=torch.zeros(4 * 6 + 4 * 4 - 1, dtype=torch.bool)), "_out_attention_mask"),
        (dict(node_token_ids=torch.zeros(2, 2, dtype=torch.long)), "node_token_ids"),
        (dict(node_depths=torch.zeros(1, 3, dtype=torch.long)), "node_depths"),
        (dict(visibility=torch.zeros(2, 4, 4, dtype=torch.long)), "visibility"),
        (dict(visibility=torch.zeros(2, 3, 4, dtype=torch.bool)), "visibility"),
        (dict(start_positions=torch.tensor([5])), "start_positions"),
        (dict(past_lens_cpu=[2]), "past_lens_cpu"),
        (dict(past_lens_cpu=[2, 1]), "past_lens_cpu"),
        (dict(tree_budget=-1), "tree_budget"),
        (dict(device=torch.device("meta")), "device"),
        (dict(root_token_ids=torch.tensor([[1, 2]])), "root_token_ids"),
    ],
)
def test_compile_value_errors(over, name):
    with pytest.raises(ValueError, match=name):
        V.compile_ddtree_tree(**compile_kwargs(**over))


def test_compile_accepts_exact_buffers_and_sizes_list():
    ids, pos = torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    mask = torch.zeros(4 * 6 + 4 * 4, dtype=torch.bool)
    out = V.compile_ddtree_tree(
        **compile_kwargs(
            _out_verify_input_ids=ids,
            _out_verify_position_ids=pos,
            _out_attention_mask=mask,
            actual_sizes_cpu=[4, 2],
        )
    )
    assert out[0].data_ptr() == ids.data_ptr() and out[2].data_ptr() == mask.data_ptr()
    assert ids.tolist() == [1, 0, 0, 0, 2, 0, 0, 0] and pos.tolist() == [5, 6, 6, 6, 6, 7, 7, 7]
    assert mask.sum() == 4 * 2 + 4 + 2 + 2  # prefix of the 4 real rows + 4 visible diagonals + 2 + 2


@pytest.mark.parametrize(
    "over, name",
    [
        (dict(draft_tokens=torch.zeros(6, dtype=torch.long)), "draft_tokens"),
        (
            dict(
                draft_tokens=torch.zeros(2, 0, dtype=torch.long),
                target_predict=torch.zeros(2, 0, dtype=torch.long),
                parents=torch.zeros(2, 0, dtype=torch.long),
            ),
            "draft_tokens",
        ),
        (dict(target_predict=torch.zeros(2, 4, dtype=torch.long)), "target_predict"),
        (dict(parents=torch.zeros(3, 3, dtype=torch.long)), "parents"),
        (dict(parents=torch.zeros(2, 3)), "parents"),
        (dict(actual_tree_sizes=torch.tensor([3])), "actual_tree_sizes"),
        (dict(accepted_indices=torch.zeros(2, 2, dtype=torch.long)), "accepted_indices"),
        (dict(accepted_token_ids=torch.zeros(1, 3, dtype=torch.long)), "accepted_token_ids"),
        (dict(accepted_lens=torch.zeros(1, dtype=torch.long)), "accepted_lens"),
        (dict(next_tokens=torch.zeros(2, 1, dtype=torch.long)), "next_tokens"),
    ],
)
def test_follow_value_errors(over, name):
    kw = dict(
        draft_tokens=torch.zeros(2, 3, dtype=torch.long),
        target_predict=torch.zeros(2, 3, dtype=torch.long),
        parents=torch.tensor([[-1, 0, 0]] * 2),
    )
    kw.update(over)
    with pytest.raises(ValueError, match=name):
        V.follow_verified_tree_gpu(**kw)


def distinct_sibling_trees(seed: int, bs: int, q: int, sizes: list[int]) -> dict:
    """Random trees whose siblings never share a token (the port's CPU child maps keep one child per
    token, the last; its GPU kernel and ours take the first, so they agree exactly on such trees)."""
    g = torch.Generator().manual_seed(seed)
    trees = random_trees(g, bs, q, sizes, vocab=4)
    for b, size in enumerate(sizes):
        for i in range(1, size):
            trees["tokens"][b, i] = 100 * int(trees["parents"][b, i]) + i % 4 + 10 * (i // 4)
    return trees


def test_against_port_cpu():
    """Ours (CPU reference path) == the port's `_compile_ddtree_tree_torch` (both mask modes) and its
    `follow_verified_tree` on child maps from `build_child_maps_from_parent_metadata`."""
    port = port_utils()
    for case in CASES:
        bs, q, budget, max_bs, sizes, pasts = case
        trees = distinct_sibling_trees(sum(sizes), bs, q, sizes)
        g = torch.Generator().manual_seed(q)
        bufs = port_buffers(g, trees, max_bs, budget, CPU)
        starts, roots = torch.randint(0, 900, (bs,), generator=g), trees["tokens"][:, 0]
        for build_mask in (True, False):
            res = []
            for fn in (V.compile_ddtree_tree, port._compile_ddtree_tree_torch):
                vis = bufs["vis"].clone()
                ids = torch.zeros(max_bs * (budget + 1), dtype=torch.long)
                out = fn(
                    roots,
                    bufs["nodes"][:bs],
                    bufs["depths"][:bs],
                    vis[:bs],
                    starts,
                    torch.tensor(pasts),
                    budget,
                    torch.tensor(sizes),
                    CPU,
                    past_lens_cpu=pasts,
                    verify_token_num=q,
                    build_attention_mask=build_mask,
                    _out_verify_input_ids=ids,
                )
                res.append((out, vis, ids))
            (ours, vis, ids), (theirs, their_vis, their_ids) = res
            for a, w in zip(ours, theirs):
                assert (a is None and w is None) or torch.equal(a, w), case
            assert torch.equal(vis, their_vis) and torch.equal(ids, their_ids), case
        for targets in ("path", "random"):
            g = torch.Generator().manual_seed(len(targets))
            target = path_targets(trees, sizes, g, 4) if targets == "path" else torch.randint(0, 4, (bs, q))
            idx, tok, lens, nxt = V.follow_verified_tree_gpu(
                draft_tokens=trees["tokens"],
                target_predict=target,
                parents=trees["parents"],
                actual_tree_sizes=torch.tensor(sizes),
            )
            maps = port.build_child_maps_from_parent_metadata(
                trees["tokens"].tolist(), trees["parents"].tolist(), sizes
            )
            their_paths, their_next, _ = port.follow_verified_tree(maps, target)
            assert lens.tolist() == [len(p) for p in their_paths] and torch.equal(nxt, their_next)
            for b, path in enumerate(their_paths):
                assert idx[b].tolist() == path + [-1] * (q - len(path))
                assert tok[b].tolist() == trees["tokens"][b, path].tolist() + [0] * (q - len(path))


@pytest.mark.gpu
@pytest.mark.parametrize("build_mask", [True, False])
def test_compile_sweep_gpu(build_mask):
    cuda = torch.device("cuda")
    for bs, q, budget in ((1, 1, 0), (8, 17, 16), (16, 64, 63), (5, 100, 128), (3, 257, 300)):
        g = torch.Generator().manual_seed(bs * q)
        sizes = torch.randint(1, q + 1, (bs,), generator=g).tolist()
        pasts = torch.randint(0, 3000, (bs,), generator=g).tolist()
        case = (bs, q, budget, bs + 1, sizes, pasts)
        (want, want_bufs), (got, got_bufs) = compile_both(case, cuda, build_mask)
        for a, w in zip(got, want):
            assert a is None or torch.equal(a, w)
        for k in want_bufs:
            assert torch.equal(got_bufs[k], want_bufs[k]), k


@pytest.mark.gpu
def test_follow_sweep_gpu():
    cuda = torch.device("cuda")
    for bs, q in ((1, 1), (8, 17), (32, 64), (5, 129), (3, 513)):
        sizes = torch.randint(1, q + 1, (bs,), generator=torch.Generator().manual_seed(q)).tolist()
        for targets in ("path", "random"):
            want_bufs, got_bufs, _, _ = follow_case((bs, q, sizes, bs + 2, q + 3), cuda, targets)
            for k in want_bufs:
                assert torch.equal(got_bufs[k], want_bufs[k]), k


@pytest.mark.gpu
def test_cuda_graph_replay():
    """Both functions capture into a CUDA graph (no host reads with the host lists given) and replay on
    new trees with the reference's results."""
    cuda = torch.device("cuda")
    bs, q, budget, sizes, pasts = 3, 9, 8, [9, 4, 1], [5, 0, 12]
    g = torch.Generator().manual_seed(0)
    static = {
        k: v.to(cuda) for k, v in port_buffers(g, random_trees(g, bs, q, sizes, 50), bs, budget, CPU).items()
    }
    follow_in = {k: torch.zeros(bs, q, dtype=torch.long, device=cuda) for k in ("draft", "target", "parents")}
    roots, starts = (
        torch.zeros(bs, dtype=torch.long, device=cuda),
        torch.zeros(bs, dtype=torch.long, device=cuda),
    )
    size_t, past_t = torch.tensor(sizes, device=cuda), torch.tensor(pasts, device=cuda)

    def step():
        c = V.compile_ddtree_tree(
            roots,
            static["nodes"],
            static["depths"],
            static["vis"],
            starts,
            past_t,
            budget,
            size_t,
            cuda,
            past_lens_cpu=pasts,
            actual_sizes_cpu=sizes,
        )
        f = V.follow_verified_tree_gpu(
            draft_tokens=follow_in["draft"],
            target_predict=follow_in["target"],
            parents=follow_in["parents"],
            actual_tree_sizes=size_t,
        )
        return c, f

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled, followed = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed + 1)
        trees = random_trees(g, bs, q, sizes, 5)
        fresh = port_buffers(g, trees, bs, budget, CPU)
        target = path_targets(trees, sizes, g, 5)
        for k in static:
            static[k].copy_(fresh[k])
        roots.copy_(trees["tokens"][:, 0])
        starts.copy_(torch.randint(0, 99, (bs,), generator=g))
        follow_in["draft"].copy_(trees["tokens"])
        follow_in["target"].copy_(target)
        follow_in["parents"].copy_(trees["parents"])
        graph.replay()
        want_c = V.compile_ddtree_tree(
            roots.cpu(),
            fresh["nodes"],
            fresh["depths"],
            fresh["vis"],
            starts.cpu(),
            past_t.cpu(),
            budget,
            size_t.cpu(),
            CPU,
        )
        want_f = ref.follow_verified_path(trees["tokens"], target, trees["parents"], torch.tensor(sizes))
        for a, w in zip(compiled, want_c):
            assert torch.equal(a.cpu(), w)
        for a, w in zip(followed, want_f):
            assert torch.equal(a.cpu(), w)
