"""Which routed experts the tokens of one forward choose, for the per-GPU Kimi-K2 layer of
`kdtree-engine bench kimi` (bench/kimi_layer.py).

A forward over b requests of n tokens each reads the weights of every routed expert that one of its
tokens chose, so its MoE cost follows the distinct experts touched (bench/experts.py). Two routings:

- "uniform": every token picks k of the E experts uniformly at random, independently of the others.
  A request's n tokens then touch U(n) = E (1 - (1 - k/E)^n) experts on average.
- "nano": the tokens of one request share experts as kimi-nano's verify forwards do. kimi-nano's
  measured distinct experts per layer against uniform's, at the same n (docs/kimi-nano.md, "Experts
  touched by a verify forward"), is carried over as a ratio r(n): a request
  touches D(n) = r(n) U(n) of Kimi-K2's experts. It is drawn so: the request gets a pool of P experts
  drawn uniformly, and each of its tokens picks k distinct experts of the pool uniformly; P is the
  smallest pool whose expected touch P (1 - (1 - k/P)^n) reaches D(n). r(n) is interpolated linearly
  between the measured n and held at its last value beyond them. kimi-nano has 16 experts, which 33
  or 65 tokens nearly exhaust whatever their routing, so its ratios at large n lean towards 1: on
  384 experts this transfer errs on the side of more experts touched.

Under 8-way expert parallelism rank r holds experts r E/8 .. (r + 1) E/8 - 1; `local_ids` gives a rank's
view (its experts renumbered from 0, the others -1, as kernels.moe.moe_experts takes them) and
`busiest_rank` the rank whose experts the forward touches most: the all-reduce after the MoE waits
for the slowest rank, so that is the rank the bench times.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kdtree_engine.bench.experts import uniform_touched

ROUTINGS = ("uniform", "nano")

# kimi-nano (docs/kimi-nano.md): (tokens n per verify forward, measured / uniform distinct experts)
NANO_TOUCH_RATIO = ((1, 1.00), (9, 0.83), (16, 0.86), (17, 0.85), (33, 0.91), (65, 0.95))


@dataclass(frozen=True)
class ExpertGrid:
    """The routed experts of the layer: E in all, k chosen per token, split over `ranks` GPUs."""

    experts: int = 384
    top_k: int = 8
    ranks: int = 8

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"ExpertGrid: expected 1 <= top_k <= experts, got {self.top_k}, {self.experts}")
        if self.ranks < 1 or self.experts % self.ranks:
            raise ValueError(f"ExpertGrid.ranks: expected a divisor of {self.experts}, got {self.ranks}")

    @property
    def per_rank(self) -> int:
        return self.experts // self.ranks


def nano_ratio(tokens: int) -> float:
    """r(n): kimi-nano's distinct experts touched over uniform routing's, interpolated (module
    docstring)."""
    if tokens < 1:
        raise ValueError(f"tokens: expected >= 1, got {tokens}")
    ns = [n for n, _ in NANO_TOUCH_RATIO]
    i = bisect.bisect_left(ns, tokens)
    if i == len(ns):
        return NANO_TOUCH_RATIO[-1][1]
    (n1, r1) = NANO_TOUCH_RATIO[i]
    if n1 == tokens or i == 0:
        return r1
    (n0, r0) = NANO_TOUCH_RATIO[i - 1]
    return r0 + (r1 - r0) * (tokens - n0) / (n1 - n0)


def pool_size(grid: ExpertGrid, tokens: int, target: float) -> int:
    """The smallest pool P (top_k <= P <= E) whose expected touch by `tokens` tokens reaches `target`."""
    for pool in range(grid.top_k, grid.experts + 1):
        if uniform_touched(pool, grid.top_k, tokens) >= target - 1e-9:
            return pool
    return grid.experts


def request_pool(grid: ExpertGrid, tokens: int, routing: str) -> int:
    """The pool of experts one request's tokens choose from under `routing`."""
    if routing == "uniform":
        return grid.experts
    if routing == "nano":
        want = nano_ratio(tokens) * uniform_touched(grid.experts, grid.top_k, tokens)
        return pool_size(grid, tokens, want)
    raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")


def route(grid: ExpertGrid, batch: int, tokens: int, routing: str, seed: int = 0) -> torch.Tensor:
    """ids [batch * tokens, top_k] int64 in 0..E-1, request-major: each request draws its pool, each of
    its tokens k distinct experts of that pool (module docstring)."""
    if batch < 1 or tokens < 1:
        raise ValueError(f"batch, tokens: expected >= 1, got {batch}, {tokens}")
    pool = request_pool(grid, tokens, routing)
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(batch):
        experts = torch.randperm(grid.experts, generator=gen)[:pool]
        picks = torch.rand(tokens, pool, generator=gen).argsort(dim=1)[:, : grid.top_k]
        ids.append(experts[picks])
    return torch.cat(ids)


def local_ids(ids: torch.Tensor, grid: ExpertGrid, rank: int) -> torch.Tensor:
    """The ids as `rank` holds the experts: its own renumbered 0 .. E/ranks - 1, every other one -1."""
    local = ids - rank * grid.per_rank
    return torch.where((local >= 0) & (local < grid.per_rank), local, -1)


def rank_load(ids: torch.Tensor, grid: ExpertGrid, rank: int) -> tuple[int, int]:
    """(distinct experts of `rank` touched, assignments to them)."""
    local = local_ids(ids, grid, rank)
    held = local[local >= 0]
    return int(held.unique().numel()), int(held.numel())


def busiest_rank(ids: torch.Tensor, grid: ExpertGrid) -> int:
    """The rank with the most distinct experts touched (then the most assignments, then the lowest)."""
    loads = [rank_load(ids, grid, r) for r in range(grid.ranks)]
    return max(range(grid.ranks), key=lambda r: (loads[r], -r))


def distinct_per_request(ids: torch.Tensor, batch: int) -> float:
    """The mean over requests of the distinct experts their tokens touch (all ranks)."""
    return sum(int(rows.unique().numel()) for rows in ids.chunk(batch)) / batch
