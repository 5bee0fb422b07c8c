"""The DeepSeek-V3 / Kimi-K2 router in two launches, the kernel twin of model.moe.Router: `route_hidden`
(the matmul as partial logits, then the routing) or `route` (the routing of given logits, one launch).

Matmul (`_logits_kernel`, grid (cdiv(n, 16), S, cdiv(E, BLOCK_E))): the hidden rows x [n, H] (any float
dtype, widened to float32 as they are loaded: no separate cast launch) times the float32 router weight
[E, H], split over H into S = cdiv(H, chunk) fixed chunks (`logit_launch`: chunks of 32 columns or
more, at most MAX_PARTS of them); each program writes the float32 partial logits of its chunk, tl.dot in
IEEE float32 (sequential FMAs on the GPU); the routing sums the S partials in order s = 0 .. S-1.
Small chunks give a decode step many programs for a weight of a few hundred KB (one program per chunk
and 16 experts), and the routing's S loads are issued together. The chunks depend on H only and every
product on its row only, so a token's logits, and so its ids and weights, are the same bits whatever the
other rows of the launch (a cuBLAS GEMM picks its kernel, and so its reduction order, by the number of
rows). They differ from torch's F.linear in the last bits.

Input of the routing: logits [n, E] float32 (or S partials summed as above) and the
e_score_correction_bias [E].
Per token row, as Router.forward: scores = sigmoid(logits), choice = scores + bias; with groups, each
of the n_group groups of E / n_group consecutive experts is scored by the sum of its two largest choice
values, the topk_group best groups are kept and the experts of the others dropped; the top_k largest
choice values among the kept experts give the ids; the weights are the scores at those ids, divided
by their sum (+ 1e-20) when norm_topk_prob, times the routed scaling factor.

Routing kernel, grid (n,): one program per row, everything in registers. The row is loaded as a 2-D block
[GP, SP] (group, expert within the group; both padded to powers of two and masked, so E = 384 runs
as [1, 512]). Every candidate is packed into one int64 key, the float32 value made monotone in the
upper 32 bits and 2^31 - 1 - index in the lower ones: keys are distinct, ordered by value and then by
the SMALLER index, and one max-reduction gives both the best value and its index. Then

- groups (only when n_group > 1): per group (axis 1) the largest key, and the largest once that one
  is removed: the top-2 sum; the kept groups are topk_group rounds of max over the group keys;
- experts: top_k rounds of max over the whole block, each removing the winner (the rest of a dropped
  group is never a candidate), so the ids come out in descending choice value, equal values in
  ascending id;
- weights: the logits at the chosen ids are loaded again (cached; the partials summed in the same
  order, so the same bits) and put through the same sigmoid, so no per-round gather is needed; the
  normalising sum is a tree reduction (torch sums in another order: the weights may differ from
  torch's in the last bit).

The sigmoid is torch's formula, 1 / (1 + exp(-x)) in float32: on the GPU libdevice's expf (the CUDA
math library's, which torch's kernel calls) and an IEEE-rounded division, so the scores and the ids
match torch's. (Triton links libdevice's flush-to-zero variant and fuses the 1 + into exp's last
multiply, by a power of two: neither changes a result.) Under the interpreter numpy's exp, which may
differ from torch's CPU exp by an ulp.
No host synchronisation and grids that depend only on the shapes, so a call can be captured in a CUDA
graph.
NaN logits are outside the contract.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release

LOGIT_ROWS = 16  # token rows per matmul program (tl.dot's minimum)
MIN_CHUNK = 32  # hidden columns per partial logit, at least
MAX_PARTS = 64  # partial logits per token, at most (the routing sums them unrolled)
NONE = tl.constexpr(-(2**63))  # below every packed key: padding, removed or dropped candidates
LOW31 = tl.constexpr(2**31 - 1)


@triton.jit
def _sigmoid(x, INTERPRET: tl.constexpr):
    """torch's 1 / (1 + exp(-x)) in float32 (libdevice expf on the GPU; the interpreter lacks it)."""
    if INTERPRET:
        e = tl.exp(-x)
    else:
        e = libdevice.exp(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _pack(value, index):
    """int64 keys ordered as (float32 value, then smaller int32 index >= 0); -0.0 packs as +0.0."""
    bits = tl.where(value == 0.0, 0, value.to(tl.int32, bitcast=True))
    mono = bits ^ ((bits >> 31) & LOW31)  # negative floats: magnitude bits reversed
    return (mono.to(tl.int64) << 32) | (index ^ LOW31).to(tl.int64)  # low: 2^31 - 1 - index


@triton.jit
def _value(key):
    """The float32 value of a packed key."""
    mono = (key >> 32).to(tl.int32)
    return (mono ^ ((mono >> 31) & LOW31)).to(tl.float32, bitcast=True)


@triton.jit
def _index(key):
    """The index of a packed key."""
    return (key & 0xFFFFFFFF).to(tl.int32) ^ LOW31


@triton.jit
def _logits(ptr, offs, mask, S: tl.constexpr, part_stride):
    """The float32 logits at offs: the sum of the S partials (part_stride apart), in order s = 0 .. S-1
    (unrolled: the S loads are issued together, not one latency after another)."""
    x = tl.load(ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        x += tl.load(ptr + s * part_stride + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _logits_kernel(x_ptr, w_ptr, part_ptr, N, H, E, stride_x, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Program (row block, chunk s, expert block): part[s, rows, experts] = x[rows, chunk s] . W[experts,
    chunk s], float32 (x widened), tl.dot in IEEE float32 over the chunk in BLOCK_K steps."""
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    s = tl.program_id(1)
    experts = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok, e_ok = rows < N, experts < E
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        ks = s * CHUNK + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        xa = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        w_mask = k_ok[:, None] & e_ok[None, :]
        wb = tl.load(w_ptr + experts[None, :] * H + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_E]
        acc = tl.dot(xa, wb, acc, input_precision="ieee")
    out = part_ptr + (s * N + rows[:, None]).to(tl.int64) * E + experts[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & e_ok[None, :])


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride, S: tl.constexpr, part_stride, scaling,
                  N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOP_K: tl.constexpr, NORM: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr,
                  KP: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)
    valid = (g[:, None] < N_GROUP) & (tl.arange(0, SP)[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + tl.arange(0, SP)[None, :]  # [GP, SP]
    x = _logits(logits_ptr, row * stride + expert, valid, S, part_stride)
    choice = _sigmoid(x, INTERPRET) + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    key = tl.where(valid, _pack(choice, expert), NONE)

    if N_GROUP > 1:
        first = tl.max(key, axis=1)  # [GP]
        second = tl.max(tl.where(key == first[:, None], NONE, key), axis=1)
        group_key = tl.where(g < N_GROUP, _pack(_value(first) + _value(second), g), NONE)
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_key, axis=0)
            keep = keep | (group_key == best)
            group_key = tl.where(group_key == best, NONE, group_key)
        key = tl.where(keep[:, None], key, NONE)

    slot = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(key, axis=1), axis=0)
        ids = tl.where(slot == i, _index(best), ids)
        key = tl.where(key == best, NONE, key)

    used = slot < TOP_K
    w = _sigmoid(_logits(logits_ptr, row * stride + ids, used, S, part_stride), INTERPRET)  # x's bits
    w = tl.where(used, w, 0.0)
    if NORM:
        w = tl.math.div_rn(w, tl.zeros_like(w) + (tl.sum(w, axis=0) + 1e-20))  # div_rn does not broadcast
    w = w * scaling
    tl.store(weights_ptr + row * TOP_K + slot, w, mask=used)
    tl.store(ids_ptr + row * TOP_K + slot, ids.to(tl.int64), mask=used)


def num_warps(block: int) -> int:
    """Warps per row program for a padded block of `block` experts: one warp up to 512 (every reduction
    by warp shuffles alone, no shared memory or barrier; 16 keys a thread fit in registers), two above."""
    return 1 if block <= 512 else 2


@dataclass(frozen=True)
class Routing:
    """The router's settings (model.moe.Router's config fields)."""

    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    scaling: float


def _check(n_experts: int, bias: torch.Tensor, r: Routing) -> None:
    if bias.dtype != torch.float32 or bias.shape != (n_experts,):
        raise ValueError(f"route: bias [E] = [{n_experts}] float32, got {bias.dtype} {tuple(bias.shape)}")
    size = n_experts // r.n_group if r.n_group > 0 else 0
    if r.n_group <= 0 or n_experts % r.n_group or size < 2 or not 0 < r.topk_group <= r.n_group:
        raise ValueError(f"route: bad groups n_group={r.n_group} topk_group={r.topk_group} for E={n_experts}")
    if not 0 < r.top_k <= r.topk_group * (n_experts // r.n_group):
        raise ValueError(f"route: top_k={r.top_k} exceeds the experts of {r.topk_group} groups")


def _route(parts: torch.Tensor, stride: int, n_experts: int, bias: torch.Tensor, r: Routing):
    """The routing launch on S partial logits `parts` [S, n, E] (rows `stride` apart, S = 1: the
    logits) -> (weights [n, top_k] float32, ids [n, top_k] int64)."""
    n_parts, n = parts.shape[0], parts.shape[1]
    weights = torch.empty(n, r.top_k, dtype=torch.float32, device=parts.device)
    ids = torch.empty(n, r.top_k, dtype=torch.int64, device=parts.device)
    if n == 0:
        return weights, ids
    gp, sp = triton.next_power_of_2(r.n_group), triton.next_power_of_2(n_experts // r.n_group)
    _route_kernel[(n,)](
        parts, bias.contiguous(), weights, ids, stride, n_parts, parts.stride(0), float(r.scaling),
        N_GROUP=r.n_group, GROUP_SIZE=n_experts // r.n_group, TOPK_GROUP=r.topk_group, TOP_K=r.top_k,
        NORM=bool(r.norm_topk_prob), GP=gp, SP=sp, KP=triton.next_power_of_2(r.top_k),
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps(gp * sp),
        **pdl.launch(parts.device),
    )  # fmt: skip
    return weights, ids


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] float32 (last dim contiguous), bias [E] float32 -> (weights [n, top_k] float32,
    ids [n, top_k] int64), ids in descending choice value (equal values: smaller id first), weights in
    the same order. Checks shapes only (no host sync)."""
    n, e = logits.shape
    if logits.dtype != torch.float32:
        raise ValueError(f"route: logits [n, E] float32, got {logits.dtype}")
    r = Routing(n_group, topk_group, top_k, norm_topk_prob, scaling)
    _check(e, bias, r)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _route(logits[None], logits.stride(0), e, bias, r)


@dataclass(frozen=True)
class LogitLaunch:
    """The matmul's launch: hidden columns per partial logit (`chunk`, fixing the reduction order),
    experts per program, hidden columns per tl.dot step, warps."""

    chunk: int
    block_e: int
    block_k: int
    num_warps: int


def logit_launch(hidden: int, n_experts: int) -> LogitLaunch:
    """The chunk: the smallest power of two >= MIN_CHUNK giving at most MAX_PARTS partials (H alone
    decides it, so a token's logits are the same bits in any launch); 16 experts and one warp a program
    (many small programs: the weight read is spread over the GPU)."""
    chunk = max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(hidden, MAX_PARTS)))
    return LogitLaunch(chunk=chunk, block_e=16, block_k=MIN_CHUNK, num_warps=1)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, H] (float32, bfloat16 or float16; last dim contiguous), weight [E, H] float32 -> the partial
    logits [S, n, E] float32, S = cdiv(H, chunk) (logit_launch): part[s] = x[:, chunk s] . weight[:,
    chunk s]^T, so that their sum in order s = 0 .. S-1 is x.float() @ weight^T. One launch."""
    n, hidden = x.shape
    n_experts = weight.shape[0]
    launch = logit_launch(hidden, n_experts)
    n_parts = triton.cdiv(hidden, launch.chunk)
    parts = torch.empty(n_parts, n, n_experts, dtype=torch.float32, device=x.device)
    if n == 0:
        return parts
    grid = (triton.cdiv(n, LOGIT_ROWS), n_parts, triton.cdiv(n_experts, launch.block_e))
    _logits_kernel[grid](x, weight.contiguous(), parts, n, hidden, n_experts, x.stride(0), CHUNK=launch.chunk,
                         BLOCK_M=LOGIT_ROWS, BLOCK_E=launch.block_e, BLOCK_K=launch.block_k,
                         num_warps=launch.num_warps, **pdl.launch(x.device))  # fmt: skip
    return parts


def route_hidden(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H] (float32, bfloat16 or float16), weight [E, H] float32, bias [E] float32 -> (weights
    [n, top_k] float32, ids [n, top_k] int64) as route(F.linear(x.float(), weight), ...), with the
    logits of router_logits: a token's result does not depend on the other rows. Two launches, no
    host sync."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype != torch.float32:
        raise ValueError(f"route_hidden: x [n, H] and weight [E, H] float32, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} {weight.dtype}")  # fmt: skip
    if not x.dtype.is_floating_point:
        raise ValueError(f"route_hidden: x must be a float tensor, got {x.dtype}")
    r = Routing(n_group, topk_group, top_k, norm_topk_prob, scaling)
    _check(weight.shape[0], bias, r)
    if x.stride(1) != 1:
        x = x.contiguous()
    parts = router_logits(x, weight)
    return _route(parts, weight.shape[0], weight.shape[0], bias, r)
