"""What a round of the auto budget tells its policy, in one launch: twin of ref.round_report.round_report_ref
(path_probabilities, round_sums and would_commit, about fifty small torch kernels per round inside the
captured accept stage).

One program per request loads its tree's node tokens and depths, each node's log-probability from the
top-k row of its depth, the ancestor bits of the visibility mask (row i: node i sees its ancestors and
itself), and sums the log-probabilities along them: the nodes' path probabilities. The bucket columns
are then masked sums of those (the first k nodes), the chain's S from the top-1 column of the top-k
(a cumulative sum over the drafted positions), and the counts of accepted nodes of index <= k. Each
column's meaning comes in as a code per bucket (ref.round_report.report_codes), so the kernel knows
nothing of the bucket list; the output is float64, the round's copy's format.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels import _interpreter  # noqa: F401
from kdtree_engine.kernels import _pdl as pdl
from kdtree_engine.kernels._pdl import wait_then_release
from kdtree_engine.tree_types import DraftTree


@triton.jit
def _report_kernel(
    lp_ptr,  # [B, L, K] float32 top-k log-probabilities per drafted position
    ids_ptr,  # [B, L, K] int64 their token ids
    tok_ptr,  # [B, n] node tokens (-1 unused)
    dep_ptr,  # [B, n] node depths, 1-based
    vis_ptr,  # [B, n + 1, n + 1] int8: the bool visibility viewed as bytes (row 0 the root)
    acc_ptr,  # [B, W] accepted node indices (root first, -1 padded)
    sum_code_ptr,  # [NB] int32: k >= 0 the first k nodes' sum, -2 the chain's S, -1 NaN
    would_code_ptr,  # [NB] int32: k >= 1 1 + the accepted nodes of index <= k, else NaN
    out_ptr,  # [B, 2 NB] float64: the sums, then the counts
    n,
    L,
    K,
    W,
    NB,
    lp_sb,
    lp_sl,
    lp_sk,
    ids_sb,
    ids_sl,
    ids_sk,
    tok_sb,
    tok_sc,
    dep_sb,
    dep_sc,
    vis_sb,
    vis_si,
    vis_sj,
    acc_sb,
    acc_sc,
    out_sb,
    N_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    L_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    NB_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # first: PDL (kernels/_pdl.py)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N_PAD)
    node = i < n
    tok = tl.load(tok_ptr + b * tok_sb + i * tok_sc, mask=node, other=-1)
    used = node & (tok >= 0)
    row = tl.maximum(tl.load(dep_ptr + b * dep_sb + i * dep_sc, mask=node, other=1) - 1, 0)
    k = tl.arange(0, K_PAD)
    tile = node[:, None] & (k < K)[None, :]
    ids = tl.load(ids_ptr + b * ids_sb + row[:, None] * ids_sl + k[None, :] * ids_sk, mask=tile, other=-1)
    lps = tl.load(lp_ptr + b * lp_sb + row[:, None] * lp_sl + k[None, :] * lp_sk, mask=tile, other=0.0)
    node_lp = tl.sum(tl.where(ids == tok[:, None], lps, 0.0), axis=1)
    node_lp = tl.where(used, node_lp, 0.0)
    j = tl.arange(0, N_PAD)
    seen = node[:, None] & (j < n)[None, :]
    vis = tl.load(
        vis_ptr + b * vis_sb + (1 + i)[:, None] * vis_si + (1 + j)[None, :] * vis_sj, mask=seen, other=0
    )
    path_lp = tl.sum(tl.where(vis != 0, node_lp[None, :], 0.0), axis=1)  # over each node's ancestors
    probs = tl.where(used, tl.exp(path_lp), 0.0)

    d = tl.arange(0, L_PAD)
    top1 = tl.load(lp_ptr + b * lp_sb + d * lp_sl, mask=d < L, other=0.0)
    chain = tl.sum(tl.where(d < L, tl.exp(tl.cumsum(top1, axis=0)), 0.0), axis=0)

    c = tl.arange(0, NB_PAD)
    code = tl.load(sum_code_ptr + c, mask=c < NB, other=-1)
    first = tl.sum(tl.where(i[None, :] < code[:, None], probs[None, :], 0.0), axis=1)
    nan = float("nan")
    sums = tl.where(code >= 0, first, tl.where(code == -2, chain, nan))

    w = tl.arange(0, W_PAD)
    nodes = tl.load(acc_ptr + b * acc_sb + (1 + w) * acc_sc, mask=(1 + w) < W, other=-1)
    upto = tl.load(would_code_ptr + c, mask=c < NB, other=-1)
    below = (nodes[None, :] > 0) & (nodes[None, :] <= upto[:, None])
    would = tl.where(upto >= 1, 1.0 + tl.sum(below.to(tl.float32), axis=1), nan)
    tl.store(out_ptr + b * out_sb + c, sums.to(tl.float64), mask=c < NB)
    tl.store(out_ptr + b * out_sb + NB + c, would.to(tl.float64), mask=c < NB)


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def round_report(
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    tree: DraftTree,
    visibility: torch.Tensor,
    accepted: torch.Tensor,
    sum_codes: torch.Tensor,
    would_codes: torch.Tensor,
) -> torch.Tensor:
    """ref.round_report.round_report_ref in one launch (inputs as there, already checked; the codes are
    int32 device tensors of ref.round_report.report_codes) -> [B, 2 len(codes)] float64."""
    b, n = tree.tokens.shape
    _, depth, k = top_logprobs.shape
    nb, width = sum_codes.shape[0], accepted.shape[1]
    out = torch.empty(b, 2 * nb, dtype=torch.float64, device=accepted.device)
    if b == 0:
        return out
    _report_kernel[(b,)](
        top_logprobs, top_ids, tree.tokens, tree.depths, visibility.view(torch.int8), accepted, sum_codes,
        would_codes, out,
        n, depth, k, width, nb,
        *top_logprobs.stride(), *top_ids.stride(), *tree.tokens.stride(), *tree.depths.stride(),
        *visibility.stride(), *accepted.stride(), out.stride(0),
        N_PAD=_pow2(n), K_PAD=_pow2(k), L_PAD=_pow2(depth), W_PAD=_pow2(width - 1), NB_PAD=_pow2(nb),
        num_warps=4,
        **pdl.launch(top_logprobs.device),
    )  # fmt: skip
    return out
