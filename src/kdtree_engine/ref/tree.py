"""Reference DDTree ops: log-softmax top-k, best-first build, compile for verify, greedy accept.

The build reproduces the official DDTree heap (liranringel/ddtree, `build_ddtree_tree`) exactly:
float64 scores updated incrementally in the official order, ties broken by the rank path; masked tokens
(-inf log-probs) never enter the tree (build_one), where the official heap would order NaN scores.
The log-softmax normalizer (log_normalizer) is defined by a fixed sequence of IEEE-754 operations, so
torch on any device, the Triton interpreter and the compiled kernel compute the same bits.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
import torch.nn.functional as F

from kdtree_engine.tree_types import AcceptResult, DraftTree, VerifyInputs

# The most nodes (root not counted) a tree op builds, for every impl: the Triton build packs node
# indices into 16-bit fields and holds its frontier, next_pow2(budget) slots, in registers
# (kernels/tree_build.py, whose MAX_BUDGET equals this); the reference, the specification of the
# kernels, takes the same range. A verify forward of 4097 nodes already carries a 4097 x 4097 mask
# per request.
MAX_BUDGET = 4096


def live(logprob: float) -> bool:
    """Whether a top-k entry may enter the tree: a -inf log-prob is a masked token (probability 0) and
    never does; NaN (unvalidated input) neither."""
    return logprob > float("-inf")


def build_one(lp: np.ndarray, ids: np.ndarray, budget: int):
    """One request. lp [L, K] float32, ids [L, K] int64.

    Returns (tokens [n], depths [n], parents [n + 1]) as Python lists, n <= budget. The official heap,
    except that a candidate whose own log-prob is not `live` (-inf: a masked token) is never pushed,
    so no score is ever -inf (the official sibling update would compute -inf - -inf = NaN there).
    Rows are sorted, so a row's masked entries are its tail: the sibling chain stops at the first."""
    depth_limit, k_avail = lp.shape
    topk = min(budget, k_avail)
    parents = [-1]
    tokens: list[int] = []
    depths: list[int] = []
    if budget <= 0 or depth_limit == 0 or not live(lp[0, 0]):
        return tokens, depths, parents
    first = float(lp[0, 0])
    # (negated score, rank path, parent index, depth, rank, score): tuple order gives the tie-break.
    heap = [(-first, (0,), 0, 1, 0, first)]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        tokens.append(int(ids[depth - 1, rank]))
        depths.append(depth)
        parents.append(parent)
        index = len(tokens)
        if rank + 1 < topk and live(lp[depth - 1, rank + 1]):
            s = score - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < depth_limit and live(lp[depth, 0]):
            s = score + float(lp[depth, 0])
            heapq.heappush(heap, (-s, ranks + (0,), index, depth + 1, 0, s))
    return tokens, depths, parents


def build_tree(top_logprobs: torch.Tensor, top_ids: torch.Tensor, budget: int) -> DraftTree:
    """top_logprobs [B, L, K] float32, top_ids [B, L, K] int64 (validated) -> DraftTree on their device."""
    b, depth_limit, _ = top_logprobs.shape
    lp = top_logprobs.detach().to("cpu", torch.float32).numpy()
    ids = top_ids.detach().to("cpu", torch.int64).numpy()
    tokens = np.full((b, budget), -1, dtype=np.int64)
    depths = np.full((b, budget), -1, dtype=np.int64)
    parents = np.full((b, budget + 1), -1, dtype=np.int64)
    num_nodes = np.zeros(b, dtype=np.int64)
    for i in range(b):
        tok, dep, par = build_one(lp[i], ids[i], budget)
        n = len(tok)
        tokens[i, :n], depths[i, :n], parents[i, : n + 1] = tok, dep, par
        num_nodes[i] = n
    dev = top_logprobs.device
    return DraftTree(
        tokens=torch.from_numpy(tokens).to(dev),
        depths=torch.from_numpy(depths).to(dev),
        parents=torch.from_numpy(parents).to(dev),
        num_nodes=torch.from_numpy(num_nodes).to(dev),
        max_depth=int(depth_limit),
    )


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, sorted descending, equal values ordered by smaller index first.

    torch.topk leaves the order of ties unspecified; bf16 logits tie often, so we pin it.
    """
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    greater = x > kth
    equal = x == kth
    need = k - greater.sum(-1, keepdim=True)
    chosen = greater | (equal & (torch.cumsum(equal.long(), -1) <= need))
    idx = chosen.nonzero()[:, -1].reshape(*x.shape[:-1], k)  # ascending index per row
    vals = torch.gather(x, -1, idx)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return torch.gather(vals, -1, order), torch.gather(idx, -1, order)


# The normalizer's constants. Every float constant is a float32 value, so a kernel may materialize
# it in float32 and widen it without changing it.
NORM_BLOCK = 2048  # logits per block: each block's partial is reduced on its own (one kernel program)
FRAC_BITS = 40  # fixed-point fraction bits of the sums, relative to a block's largest term
MAX_VOCAB = 2**22  # the int64 row sum stays below 2^63: V * sqrt(2) * 2^FRAC_BITS < 2^63
LOG2E = 1.4426950216293335  # log2(e) rounded to float32
D_MIN = -44.0  # exp_nonpositive clamps d here: 2^FRAC_BITS exp(-44) and 2^52 exp(-44) are < 1
ROUND = 12582912.0  # 1.5 * 2^23: in [2^23, 2^24) the float32 spacing is 1, so x + ROUND rounds x
EXP2_POLY = (  # 2^r for r in [-1/2, 1/2], Horner with fused multiply-adds in float32: relative error < 1.6e-7
    1.0,
    0.6931470036506653,
    0.24022246897220612,
    0.0555071122944355,
    0.009671294130384922,
    0.0013269407209008932,
)
LOG1P_POLY = (  # ln(1 + t) / t for t in [sqrt(1/2) - 1, sqrt(2) - 1], Horner in float64: error < 4e-10
    1.0,
    -0.5,
    0.3333331048488617,
    -0.24999986588954926,
    0.20002223551273346,
    -0.16669249534606934,
    0.14218716323375702,
    -0.12384402006864548,
    0.11872619390487671,
    -0.11789370328187943,
    0.06915612518787384,
)
SQRT2 = 1.4142135381698608  # float32(sqrt(2)): mantissas above it are halved
LN2_HI, LN2_LO = 0.6931471824645996, -1.9046542121259336e-09  # ln 2 = LN2_HI + LN2_LO to 2^-53


def fma32(a: torch.Tensor, b, c) -> torch.Tensor:
    """float32 a * b + c rounded once (IEEE-754 fusedMultiplyAdd, what a GPU's fma does); b, c: float32
    tensors or float32-exact floats. The product is exact in float64; the float64 sum is made round-to-odd
    (an inexact result with an even last bit moves one ulp toward the exact sum, whose sign TwoSum gives),
    and rounding that to float32 is the correct rounding (Boldo and Melquiond: 53 >= 24 + 2 bits)."""
    p = a.double() * b
    c = torch.as_tensor(c, dtype=torch.float64)
    s = p + c
    back = s - p
    err = (p - (s - back)) + (c - back)  # p + c = s + err exactly
    bits = s.view(torch.int64)
    toward = torch.where((err > 0) == (s > 0), 1, -1)  # +1 on the bits: one ulp away from zero
    return torch.where((err != 0) & (bits & 1 == 0), bits + toward, bits).view(torch.float64).float()


def exp_nonpositive(d: torch.Tensor) -> torch.Tensor:
    """float32 d <= 0 (-inf allowed) -> float32 exp(max(d, D_MIN)), relative error < 1.6e-7 + 1.5e-8 |d|.

    d log2(e) = n + r with n the nearest integer (from the low bits of d log2(e) + ROUND) and r in
    [-1/2, 1/2] (one rounding); 2^r is a polynomial and 2^n is built from its exponent bits, so the
    product is exact."""
    d = torch.clamp_min(d, D_MIN)
    n = fma32(d, LOG2E, ROUND) - ROUND
    r = fma32(d, LOG2E, -n)
    p = torch.full_like(r, EXP2_POLY[-1])
    for c in reversed(EXP2_POLY[:-1]):
        p = fma32(p, r, c)
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def log_fixed(s: torch.Tensor) -> torch.Tensor:
    """int64 s >= 2^FRAC_BITS -> float64 ln(s 2^-FRAC_BITS), error < 1e-9: s rounded once to float64
    (its two 32-bit halves are exact), split as m 2^e with m in [sqrt(1/2), sqrt(2)], ln m a polynomial."""
    hi = s >> 32
    f = hi.double() * 4294967296.0 + (s - (hi << 32)).double()
    bits = f.view(torch.int64)
    m = ((bits & (2**52 - 1)) | (1023 << 52)).view(torch.float64)  # f = m 2^e, m in [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = ((bits >> 52) - 1023 + big.long() - FRAC_BITS).double()
    t = m - 1.0
    q = torch.full_like(t, LOG1P_POLY[-1])
    for c in reversed(LOG1P_POLY[:-1]):
        q = q * t + c  # a rounded multiply, then a rounded add
    return (e * LN2_HI + t * q) + e * LN2_LO


def log_normalizer(logits: torch.Tensor, *, block: int = NORM_BLOCK) -> torch.Tensor:
    """logits [..., V] float32 (V <= MAX_VOCAB, each row with a value > -inf) -> [..., 1] float32, the
    row's logsumexp within about 2e-7 of max(1, |logsumexp|).

    Every step is exact or one IEEE-754 rounding (add, multiply, fused multiply-add, conversion; no
    library exp or log), and the sums are integers, so the result depends neither on the summation
    order nor on the device. The row is cut into blocks of `block` logits (padded with -inf), as a
    kernel reads it in one pass without knowing the row max: block b, with max m_b, sums
    trunc(exp_nonpositive(x - m_b) 2^FRAC_BITS) exactly in int64; with m the row max, each block sum
    is rescaled to trunc(float64(s_b) float64(exp_nonpositive(m_b - m))) and the int64 results are
    added into S; the normalizer is float32(float64(m) + log_fixed(S)). S >= 2^FRAC_BITS (the largest
    logit's term is exactly 2^FRAC_BITS), so the normalizer is >= m and every log-prob <= 0."""
    return combine_block_partials(*block_partials(logits, block=block))


def block_partials(logits: torch.Tensor, *, block: int = NORM_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass of log_normalizer: logits [..., V] -> (m_b [..., nb] float32 block maxima, s_b
    [..., nb] int64 exact block sums of trunc(exp_nonpositive(x - m_b) 2^FRAC_BITS)), nb = ceil(V /
    block), the last block padded with -inf. Blocks are independent, so a vocabulary split at multiples
    of `block` (tensor-parallel shards) gives the same partials shard by shard."""
    if not 0 < block <= 4096:
        raise ValueError(
            f"block: expected 1..4096 (the int64 block sum must stay exact in float64), got {block}"
        )
    v = logits.shape[-1]
    x = F.pad(logits, (0, -v % block), value=float("-inf")).unflatten(-1, (-1, block))
    m_b = x.amax(-1, keepdim=True)
    d = x - torch.where(m_b == float("-inf"), 0.0, m_b)
    s_b = (exp_nonpositive(d) * float(2**FRAC_BITS)).long().sum(-1)
    return m_b.squeeze(-1), s_b


def combine_block_partials(m_b: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """The second pass of log_normalizer: every block sum rescaled to the row max and added exactly in
    int64, so the order of the blocks does not matter -> [..., 1] float32."""
    m = m_b.amax(-1, keepdim=True)
    s = (s_b.double() * exp_nonpositive(m_b - m).double()).long().sum(-1, keepdim=True)
    return (m.double() + log_fixed(s)).float()


def logits_to_topk(
    draft_logits: torch.Tensor, budget: int, *, block: int = NORM_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [B, L, V] -> (top_logprobs [B, L, k] float32, top_ids [B, L, k] int64),
    k = min(budget, V): the top-k of the float32 logits (ties: smaller id first) minus
    log_normalizer (`block`: its block size, to be changed by tests only)."""
    logits = draft_logits.float()
    k = min(budget, logits.shape[-1])
    top_vals, top_ids = topk_stable(logits, k)
    return top_vals - log_normalizer(logits, block=block), top_ids


def compile_tree(tree: DraftTree, root_tokens: torch.Tensor, start_positions: torch.Tensor) -> VerifyInputs:
    """Positions, visibility, ancestor bitmask and EAGLE arrays for one batch of trees."""
    b, n = tree.batch_size, tree.budget + 1
    parents = tree.parents.cpu().numpy()
    depths = tree.depths.cpu().numpy()
    tokens = tree.tokens.cpu().numpy()
    counts = tree.num_nodes.cpu().numpy()
    roots = root_tokens.cpu().numpy()
    starts = start_positions.cpu().numpy()

    input_ids = np.zeros((b, n), np.int64)
    positions = np.zeros((b, n), np.int64)
    vis = np.zeros((b, n, n), np.bool_)
    index = np.full((b, n), -1, np.int64)
    next_token = np.full((b, n), -1, np.int64)
    next_sibling = np.full((b, n), -1, np.int64)
    for r in range(b):
        used = int(counts[r]) + 1
        input_ids[r, 0], input_ids[r, 1:used] = roots[r], tokens[r, : used - 1]
        positions[r, :] = starts[r]
        positions[r, 1:used] += depths[r, : used - 1]
        index[r, :used] = r * n + np.arange(used)
        last_child = {}
        for i in range(n):
            vis[r, i, i] = True
            if i == 0 or i >= used:
                continue
            p = int(parents[r, i])
            vis[r, i, :i] |= vis[r, p, :i]
            if p in last_child:
                next_sibling[r, last_child[p]] = i
            else:
                next_token[r, p] = i
            last_child[p] = i
    bits = None
    if n <= 64:
        weights = np.array([1 << j for j in range(n)], dtype=np.uint64)
        bits = (vis.astype(np.uint64) * weights).sum(-1, dtype=np.uint64).view(np.int64)
    dev = tree.device

    def out(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    return VerifyInputs(
        input_ids=out(input_ids),
        positions=out(positions),
        visibility=out(vis),
        ancestor_bits=None if bits is None else out(bits),
        retrieve_index=out(index),
        retrieve_next_token=out(next_token),
        retrieve_next_sibling=out(next_sibling),
    )


def walk(tokens: np.ndarray, parents: np.ndarray, count: int, target: np.ndarray) -> list[int]:
    """Accepted node indices of one tree, root first. A later sibling with the same token wins,
    as in the official child maps (dict overwrite); top-k ids are distinct, so it never arises there."""
    children: list[dict[int, int]] = [dict() for _ in range(count + 1)]
    for i in range(1, count + 1):
        children[int(parents[i])][int(tokens[i - 1])] = i
    path = [0]
    while int(target[path[-1]]) in children[path[-1]]:
        path.append(children[path[-1]][int(target[path[-1]])])
    return path


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """target_tokens [B, N] int64: the target's token at every tree node (argmax, or a sample)."""
    b = tree.batch_size
    tokens = tree.tokens.cpu().numpy()
    parents = tree.parents.cpu().numpy()
    counts = tree.num_nodes.cpu().numpy()
    target = target_tokens.cpu().numpy()
    accepted = np.full((b, tree.max_depth + 1), -1, np.int64)
    lengths = np.zeros(b, np.int64)
    bonus = np.zeros(b, np.int64)
    for r in range(b):
        path = walk(tokens[r], parents[r], int(counts[r]), target[r])
        accepted[r, : len(path)] = path
        lengths[r] = len(path)
        bonus[r] = target[r, path[-1]]
    dev = tree.device
    return AcceptResult(
        accepted=torch.from_numpy(accepted).to(dev),
        accept_len=torch.from_numpy(lengths).to(dev),
        bonus=torch.from_numpy(bonus).to(dev),
    )
