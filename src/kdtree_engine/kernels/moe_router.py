"""The DeepSeek-V3 / Kimi-K2 router after its matmul in one launch, the kernel twin of model.moe.Router.

Input: logits [n, E] float32 (the router matmul, kept outside) and the e_score_correction_bias [E].
Per token row, as Router.forward: scores = sigmoid(logits), choice = scores + bias; with groups, each
of the n_group groups of E / n_group consecutive experts is scored by the sum of its two largest choice
values, the topk_group best groups are kept and the experts of the others dropped; the top_k largest
choice values among the kept experts give the ids; the weights are the scores at those ids, divided
by their sum (+ 1e-20) when norm_topk_prob, times the routed scaling factor.

Kernel, grid (n,): one program per row, everything in registers. The row is loaded as a 2-D block
[GP, SP] (group, expert within the group; both padded to powers of two and masked, so E = 384 runs
as [1, 512]). Every candidate is packed into one int64 key, the float32 value made monotone in the
upper 32 bits and 2^31 - 1 - index in the lower ones: keys are distinct, ordered by value and then by
the SMALLER index, and one max-reduction gives both the best value and its index. Then

- groups (only when n_group > 1): per group (axis 1) the largest key, and the largest once that one
  is removed: the top-2 sum; the kept groups are topk_group rounds of max over the group keys;
- experts: top_k rounds of max over the whole block, each removing the winner (the rest of a dropped
  group is never a candidate), so the ids come out in descending choice value, equal values in
  ascending id;
- weights: the logits at the chosen ids are loaded again (cached) and put through the same sigmoid,
  so no per-round gather is needed; the normalising sum is a tree reduction (torch sums in another
  order: the weights may differ from torch's in the last bit).

The sigmoid is torch's formula, 1 / (1 + exp(-x)) in float32: on the GPU libdevice's expf (the CUDA
math library's, which torch's kernel calls) and an IEEE-rounded division, so the scores and the ids
match torch's. (Triton links libdevice's flush-to-zero variant and fuses the 1 + into exp's last
multiply, by a power of two: neither changes a result.) Under the interpreter numpy's exp, which may
differ from torch's CPU exp by an ulp.
No host synchronisation and a grid that depends only on n, so a call can be captured in a CUDA graph.
NaN logits are outside the contract.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kdtree_engine.kernels import _interpreter  # noqa: F401 - patches the CPU interpreter when it runs

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
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride, scaling, N_GROUP: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  NORM: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr,
                  INTERPRET: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)
    valid = (g[:, None] < N_GROUP) & (tl.arange(0, SP)[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + tl.arange(0, SP)[None, :]  # [GP, SP]
    x = tl.load(logits_ptr + row * stride + expert, mask=valid, other=0.0)
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
    w = _sigmoid(tl.load(logits_ptr + row * stride + ids, mask=used, other=0.0), INTERPRET)
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
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or bias.shape != (e,):
        raise ValueError(f"route: logits [n, E] and bias [E] float32, got {logits.dtype} {bias.shape}")
    if n_group <= 0 or e % n_group or e // n_group < 2 or not 0 < topk_group <= n_group:
        raise ValueError(f"route: bad groups n_group={n_group} topk_group={topk_group} for E={e}")
    if not 0 < top_k <= topk_group * (e // n_group):
        raise ValueError(f"route: top_k={top_k} exceeds the experts of {topk_group} groups")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = bias.contiguous()
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, ids
    gp, sp = triton.next_power_of_2(n_group), triton.next_power_of_2(e // n_group)
    _route_kernel[(n,)](
        logits, bias, weights, ids, logits.stride(0), float(scaling),
        N_GROUP=n_group, GROUP_SIZE=e // n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        NORM=bool(norm_topk_prob), GP=gp, SP=sp, KP=triton.next_power_of_2(top_k),
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps(gp * sp),
    )  # fmt: skip
    return weights, ids
