"""Reference mixture-of-experts layer after the router, on stacked expert weights.

`moe_experts_ref` is the specification of kernels.moe.moe_experts. It runs the operations of
model.moe.MoE one for one (the same grouping, order, dtypes and accumulation), so given the same
weights it returns the same bits; the weights of the E routed experts are stacked:

    w_gate_up [E, 2I, H]   rows 0..I-1: gate_proj.weight, rows I..2I-1: up_proj.weight of expert e
    w_down    [E, H, I]    down_proj.weight of expert e

and the shared expert, when there is one, is the triple `shared` = (gate_proj.weight [Is, H],
up_proj.weight [Is, H], down_proj.weight [H, Is]) of model.moe.MLP.

Expert parallelism: an id of -1 marks an assignment to an expert that this rank does not hold (its
weights live on another GPU, which adds its share in the all-reduce). Such an assignment adds nothing
here and takes no row of the tile map.

`tile_map_ref` is the specification of kernels.moe.tile_map, the grouping of the assignments by expert
into row tiles (see kernels/moe.py). Both loop or sync on the host: they are the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Shared = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w_gate [Is, H], w_up [Is, H], w_down [H, Is]


def max_tiles(n_assign: int, n_experts: int, block_m: int) -> int:
    """Static bound on the row tiles: sum_e cdiv(count_e, block_m) over at most min(E, n_assign) used
    experts whose counts add up to n_assign."""
    return (n_assign + min(n_experts, n_assign) * (block_m - 1)) // block_m


def _check_shared(shared: Shared, hidden: int, dtype: torch.dtype) -> None:
    if len(shared) != 3 or any(w.dim() != 2 for w in shared):
        raise ValueError("moe: shared must be (w_gate [Is, H], w_up [Is, H], w_down [H, Is])")
    w_gate, w_up, w_down = shared
    inter = w_gate.shape[0]
    want = [(inter, hidden), (inter, hidden), (hidden, inter)]
    if [tuple(w.shape) for w in shared] != want:
        got = [tuple(w.shape) for w in shared]
        raise ValueError(f"moe: shared {got} do not match [Is, {hidden}], [Is, {hidden}], [{hidden}, Is]")
    if any(w.dtype != dtype for w in shared):
        raise ValueError(f"moe: shared expert weights must have x's dtype {dtype}")


def check_moe_args(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Shared | None = None,
) -> tuple[int, int, int, int, int]:
    """Validates shapes and dtypes (metadata only, no device sync); returns (n, k, E, H, I)."""
    if x.dim() != 2 or weights.dim() != 2 or ids.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError("moe: expected x [n, H], weights/ids [n, k], w_gate_up [E, 2I, H], w_down [E, H, I]")
    n, hidden = x.shape
    n_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    if weights.shape != ids.shape or ids.shape[0] != n:
        raise ValueError(f"moe: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must be [{n}, k]")
    if two_inter % 2 or w_gate_up.shape[2] != hidden or tuple(w_down.shape) != (n_experts, hidden, inter):
        raise ValueError(
            f"moe: w_gate_up {tuple(w_gate_up.shape)} / w_down {tuple(w_down.shape)} do not match "
            f"[E, 2I, {hidden}] / [E, {hidden}, I]"
        )
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"moe: expert weights must have x's dtype {x.dtype}")
    if weights.dtype != torch.float32 or ids.dtype != torch.int64:
        raise ValueError(f"moe: expected float32 weights and int64 ids, got {weights.dtype}, {ids.dtype}")
    if shared is not None:
        _check_shared(shared, hidden, x.dtype)
    return n, ids.shape[1], n_experts, hidden, inter


def shared_expert_ref(x: torch.Tensor, shared: Shared) -> torch.Tensor:
    """x [n, H] -> [n, H] in x's dtype: down(silu(gate(x)) * up(x)), as model.moe.MLP."""
    w_gate, w_up, w_down = shared
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: Shared | None = None,
) -> torch.Tensor:
    """x [n, H], weights [n, k] float32 (already scaled), ids [n, k] int64 in -1..E-1 -> [n, H] in x's
    dtype: for every token, the sum over its k choices of weight * down(silu(gate(x)) * up(x)), plus
    the shared expert's output when `shared` is given; a choice of -1 (an expert on another rank)
    adds nothing.

    The assignments (token, slot) are grouped by expert with a stable argsort of ids.flatten() (the -1
    ones last, skipped); the experts run in increasing id order, each on its tokens at once; an
    expert's output (x's dtype) times the float32 weight promotes to float32, is cast back to x's dtype
    and index_add_-ed into zeros_like(x), as model.moe.MoE does; the shared expert's output is added
    last, in x's dtype."""
    _, k, n_experts, _, inter = check_moe_args(x, weights, ids, w_gate_up, w_down, shared)
    order = _expert_order(ids.flatten(), n_experts)  # [n * k] assignment slots grouped by expert
    counts = _local_counts(ids.flatten(), n_experts).tolist()
    out = torch.zeros_like(x)
    begin = 0
    for e, count in enumerate(counts):
        if count:
            chosen = order[begin : begin + count]
            token, slot = chosen // k, chosen % k
            x_tok = x[token]
            h = F.silu(F.linear(x_tok, w_gate_up[e, :inter])) * F.linear(x_tok, w_gate_up[e, inter:])
            y = F.linear(h, w_down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        begin += count
    return out if shared is None else out + shared_expert_ref(x, shared)


def _expert_order(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The stable argsort of the flat ids, the -1 ones (experts on another rank) last."""
    return torch.where(flat < 0, n_experts, flat).argsort(stable=True)


def _local_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] assignments per expert held here (the -1 ones not counted)."""
    return torch.bincount(flat[flat >= 0], minlength=n_experts)


def tile_map_ref(
    ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, k] int64 in -1..E-1 -> (order [n k] int64, bounds [E + 1] int32, tile_expert [T] int32,
    tile_row [T] int32), T = max_tiles(n k, E, block_m), as kernels.moe.tile_map:

    - order: the stable argsort of ids.flatten() (within an expert, increasing flat index token k + slot),
      the -1 assignments last; the kernel leaves its rows from bounds[E] on unwritten;
    - bounds: expert e's sorted rows are bounds[e] .. bounds[e + 1] - 1 (bounds[E]: the assignments held
      here);
    - the tiles: expert by expert in increasing id, cdiv(count_e, block_m) tiles each, tile j of e
      starting at sorted row bounds[e] + j block_m; the T - (real tiles) idle tiles after them have
      expert E and row 0."""
    flat = ids.reshape(-1)
    dev, n_tiles = ids.device, max_tiles(flat.numel(), n_experts, block_m)
    counts = _local_counts(flat, n_experts)
    bounds = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    bounds[1:] = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m  # [E]
    expert = torch.repeat_interleave(torch.arange(n_experts, device=dev), tiles)  # [real tiles]
    j = torch.arange(len(expert), device=dev) - (tiles.cumsum(0) - tiles)[expert]
    tile_expert = torch.full((n_tiles,), n_experts, dtype=torch.int32, device=dev)
    tile_row = torch.zeros(n_tiles, dtype=torch.int32, device=dev)
    tile_expert[: len(expert)] = expert.int()
    tile_row[: len(expert)] = (bounds[expert] + j * block_m).int()
    return _expert_order(flat, n_experts), bounds.int(), tile_expert, tile_row
