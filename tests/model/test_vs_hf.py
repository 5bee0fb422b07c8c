"""Our model against transformers' DeepseekV3ForCausalLM (same random weights, CPU): full forward,
prefill + decode, tree verify with an ancestor mask, compaction + decode, ragged prefill."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_compare import CONFIGS, hf_logits, hf_pair, rel_diff, tolerance

pytest.importorskip("transformers")

# Two trees (parents of nodes 0..6, node 0 is the root) and the accepted root-to-node paths.
PARENTS = ([-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 2, 0, 5])
ACCEPTED = ([0, 1, 3, 6], [0, 5])


def _paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for i in range(len(parents)):
        p, node = [], i
        while node != -1:
            p.append(node)
            node = parents[node]
        paths.append(p[::-1])
    return paths


def _visibility(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i, path in enumerate(_paths(parents)):
        vis[i, path] = True
    return vis


class Diffs:
    """Max |ours - transformers| per scenario, over every compared logit row."""

    def __init__(self) -> None:
        self.d: dict[str, float] = {}
        self.scale = 0.0

    def add(self, key: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        diff = float((got.double() - ref.double()).abs().max())
        self.d[key] = max(self.d.get(key, 0.0), diff)
        self.scale = max(self.scale, float(ref.abs().max()))


def _full(hf, ours, gen, diffs: Diffs) -> None:
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=gen)
    got = ours(ids, ours.new_cache(2, 12)).logits
    diffs.add("full", got, hf(ids).logits)


def _prefill_decode(hf, ours, gen, diffs: Diffs) -> None:
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=gen)
    cache = ours.new_cache(2, 12)
    ref = hf(ids).logits
    diffs.add("decode", ours(ids[:, :7], cache).logits, ref[:, :7])
    for i in range(7, 12):
        diffs.add("decode", ours(ids[:, i : i + 1], cache).logits[:, 0], ref[:, i])


def _ragged_prefill(hf, ours, prompts, max_len, diffs: Diffs):
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    cache = ours.new_cache(len(prompts), max_len)
    got = ours(ids, cache, lengths=lengths).logits
    assert cache.seqlens.tolist() == lengths.tolist()
    for b, p in enumerate(prompts):
        diffs.add("ragged", got[b, : len(p)], hf_logits(hf, p))
    return cache


def _tree_verify(hf, ours, gen, prompts, cache, diffs: Diffs) -> tuple[torch.Tensor, list[list[int]]]:
    v = ours.config.vocab_size
    trees = [torch.randint(0, v, (len(p),), generator=gen).tolist() for p in PARENTS]
    depths = torch.tensor([[len(path) - 1 for path in _paths(p)] for p in PARENTS])
    start = cache.seqlens.clone()
    vis = torch.stack([_visibility(p) for p in PARENTS])
    got = ours(torch.tensor(trees), cache, positions=start[:, None] + depths, visibility=vis).logits
    for b, parents in enumerate(PARENTS):
        for i, path in enumerate(_paths(parents)):
            ref = hf_logits(hf, prompts[b] + [trees[b][j] for j in path])
            diffs.add("tree", got[b, i], ref[-1])
    return start, trees


def _compact_decode(hf, ours, gen, prompts, cache, start, trees, diffs: Diffs) -> None:
    keep = torch.full((2, 4), -1, dtype=torch.int64)
    for b, acc in enumerate(ACCEPTED):
        keep[b, : len(acc)] = torch.tensor(acc)
    cache.compact(start, keep, torch.tensor([len(a) for a in ACCEPTED]))
    seqs = [prompts[b] + [trees[b][j] for j in ACCEPTED[b]] for b in range(2)]
    for _ in range(3):
        nxt = torch.randint(0, ours.config.vocab_size, (2, 1), generator=gen)
        got = ours(nxt, cache).logits[:, 0]
        for b in range(2):
            seqs[b].append(int(nxt[b, 0]))
            diffs.add("compact", got[b], hf_logits(hf, seqs[b])[-1])


@torch.no_grad()
def scenario_diffs(name: str, dtype: torch.dtype, seed: int = 0) -> dict[str, float]:
    hf, ours = hf_pair(name, dtype)
    gen = torch.Generator().manual_seed(seed)
    diffs = Diffs()
    _full(hf, ours, gen, diffs)
    _prefill_decode(hf, ours, gen, diffs)
    v = ours.config.vocab_size
    prompts = [torch.randint(0, v, (n,), generator=gen).tolist() for n in (6, 11)]
    cache = _ragged_prefill(hf, ours, prompts, 24, diffs)
    start, trees = _tree_verify(hf, ours, gen, prompts, cache, diffs)
    _compact_decode(hf, ours, gen, prompts, cache, start, trees, diffs)
    return {**diffs.d, "scale": diffs.scale}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(name: str, dtype: torch.dtype) -> None:
    d = scenario_diffs(name, dtype)
    worst = max(v for k, v in d.items() if k != "scale") / d["scale"]
    assert worst <= tolerance(dtype), f"{name} {dtype}: relative {worst:.2e}, abs diffs {d}"


@torch.no_grad()
def test_routing_differs_across_configs() -> None:
    """Sanity that the comparisons can fail: a wrong correction bias changes the logits."""
    hf, ours = hf_pair("base", torch.float64)
    ids = torch.randint(0, ours.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = hf(ids).logits
    layer = ours.layers[1].mlp.gate
    saved = layer.e_score_correction_bias.clone()
    try:
        layer.e_score_correction_bias.copy_(-saved)
        assert rel_diff(ours(ids, ours.new_cache(1, 10)).logits, ref) > 1e-4
    finally:
        layer.e_score_correction_bias.copy_(saved)
