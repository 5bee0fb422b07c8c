"""Reference sampled accept (temperature > 0, top-k, top-p), defined so a GPU kernel can match it bit
for bit.

Every tree node draws its target token independently by the Gumbel-max trick:

    token = argmax_v [ x_v >= cutoff ]  ( x_v / T  +  g_v ),   ties -> the smaller id

with x the logits as float32, T the temperature rounded to float32, `x_v / T` a correctly rounded
float32 division, `+ g_v` a float32 add (no FMA can change it: the only multiply, in seeded g, is by a
power of two and exact), g standard Gumbel noise float32, either an explicit tensor [B, N, V] (drawn
from a torch.Generator, or given) or seeded (below), and `cutoff` [B, N] a raw float32 logit below
which a token is excluded. Only comparisons, one division and one add touch the logits, so the kernel
and this reference agree exactly given the same noise and cutoffs.

The cutoff carries top-k and top-p (`sampling_cutoffs`): top-k keeps logits >= the k-th largest logit,
top-p then keeps the shortest run of largest logits whose renormalised tempered probability reaches
top_p. Logits tied with the cutoff are all kept. Top-p sums probabilities, so its cutoff can differ
by float rounding between devices when the mass sits within rounding of top_p; the public op computes
cutoffs once, on the logits' device, and both implementations consume the same cutoffs.

Seeded noise (`seed`, `offset`): instead of a [B, N, V] tensor, g is a pure function of
(seed, offset, b, n, v) computed with integers only, so the kernel and this reference produce the same
bits without sharing any float transcendental:

    h = mix(mix(v ^ r0) ^ r1)                 32-bit hash; (r0, r1) = row_keys(seed, offset)[b, n]
    u = (h + 1/2) / 2^32                      never 0 or 1
    G = floor(2^18 * -ln(-ln u))              fixed point, integer arithmetic only (gumbel_fixed)
    g = (2 G + 1) * 2^-19  (float32)          |2G+1| < 2^24: exact in float32, never 0

`mix` is a murmur-style 32-bit finalizer (lowbias32). The logarithms are table + short series in Q30
integers (`_log_parts`); every product stays below 2^63 and every shift is arithmetic on int64, so
torch (here) and Triton (kernels/tree_sample.py) agree bit for bit. g is on a 2^-18 grid (noise
error < 2^-19 + 2^-21, a relative change of the sampling probabilities of a few 1e-6) and lies in
(-3.2, 22.9]: `GUMBEL_MAX` bounds it from above, which lets the kernel skip tiles that cannot win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kdtree_engine.ref import tree as ref_tree  # module import: ref.tree may still be initializing
from kdtree_engine.tree_types import AcceptResult, DraftTree


def float32_temperature(temperature: float) -> float:
    """The temperature as the float32 value both implementations divide by."""
    return float(np.float32(temperature))


def gumbel_noise(shape, *, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Standard Gumbel noise [*shape] float32: -log(-log(u)), u uniform, drawn on `device` (the
    generator's device when a generator is given)."""
    if generator is not None:
        device = generator.device
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    u = u.clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


MASK32 = 0xFFFFFFFF
STREAM_INITS = (0x3C6EF372, 0xA54FF53A)  # one 32-bit key chain each: 64 key bits per row
Q = 30  # fixed-point fraction bits of the logarithms
LN2_Q = round(math.log(2.0) * 2**Q)
THIRD_Q = round(2**Q / 3)
FIVE_24THS_Q = round(5 * 2**Q / 24)
TABLE_BITS = 8
# Tang's table: c_i ~ 1 / (1 + (i + 1/2) / 256) in Q31 and -ln(c_i) in Q30, for m in [1, 2) with top
# fraction bits i, m * c_i = 1 + r with |r| <= 2^-9. Both implementations read these same integers.
RECIP_TABLE = [round(2**31 / (1 + (i + 0.5) / 2**TABLE_BITS)) for i in range(2**TABLE_BITS)]
LOG_TABLE = [round(-math.log(c / 2**31) * 2**Q) for c in RECIP_TABLE]
G_SHIFT = Q - 18  # G keeps 18 fraction bits
GRID_HALF = 2.0 ** -(Q - G_SHIFT + 1)  # 2^-19
GUMBEL_MAX = 23.0  # > every seeded g: -ln(-ln(1 - 2^-33)) = 22.87
SEEDED_CHUNK = 1 << 20  # seeded noise elements the reference holds at once


def _mul32(x, c: int):
    """x * c mod 2^32 for x in [0, 2^32) (int or int64 tensor) and a constant c < 2^32, with every
    partial product below 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x):
    """lowbias32 (a murmur3-style finalizer, a bijection of [0, 2^32)); x an int or int64 tensor."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def check_seed_range(seed: int, offset: int) -> None:
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {seed}")
    if not 0 <= offset < 2**64:
        raise ValueError(f"offset: expected an int in [0, 2**64), got {offset}")


def stream_keys(seed: int, offset: int) -> tuple[int, int]:
    """The (seed, offset) part of the row keys: two 32-bit ints (host side, plain Python)."""
    check_seed_range(seed, offset)
    return _stream_chain(seed, offset)


def _stream_chain(seed: int, offset):
    """stream_keys' two key chains over the words of seed and offset (an int, or an int64 tensor of
    offsets: the same chain for each at once), unchecked."""
    k0, k1 = STREAM_INITS
    for w in (seed & MASK32, seed >> 32, offset & MASK32, offset >> 32):
        k0, k1 = mix32(k0 ^ w), mix32(k1 ^ w)
    return k0, k1


def row_keys(seed: int, offset: int, batch: int, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(r0, r1) [B, N] int64 in [0, 2^32): r_i = mix(mix(p_i ^ b) ^ n), (p0, p1) = stream_keys."""
    b = torch.arange(batch, dtype=torch.int64)[:, None]
    n = torch.arange(nodes, dtype=torch.int64)[None, :]
    return tuple(mix32(mix32(p ^ b) ^ n) for p in stream_keys(seed, offset))


def hash_bits(r0: torch.Tensor, r1: torch.Tensor, vocab: int) -> torch.Tensor:
    """r0, r1 [...] int64 row keys -> h [..., V] int64 in [0, 2^32): mix(mix(v ^ r0) ^ r1)."""
    v = torch.arange(vocab, dtype=torch.int64)
    return mix32(mix32(v ^ r0[..., None]) ^ r1[..., None])


def _log_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x int64 in [1, 2^40) -> (k, f) int64 with ln x ~ k ln 2 + f / 2^30 (|error| < 2^-27):
    k = floor(log2 x) from the exponent of x as a float64 (exact: x < 2^53), m = x / 2^k in Q30,
    f = -ln(c_i) + ln(1 + r) with m c_i = 1 + r, ln(1 + r) ~ r - r^2/2 + r^3/3."""
    k = (x.to(torch.float64).view(torch.int64) >> 52) - 1023
    m = torch.where(k <= Q, x << (Q - k).clamp(min=0), x >> (k - Q).clamp(min=0))  # [2^30, 2^31)
    i = (m >> (Q - TABLE_BITS)) & (2**TABLE_BITS - 1)
    recip = torch.tensor(RECIP_TABLE, dtype=torch.int64)[i]
    r = ((m * recip) >> 31) - (1 << Q)
    r2 = (r * r) >> Q
    r3 = (r2 * r) >> Q
    f = torch.tensor(LOG_TABLE, dtype=torch.int64)[i] + r - (r2 >> 1) + ((r3 * THIRD_Q) >> Q)
    return k, f


def gumbel_fixed(h: torch.Tensor) -> torch.Tensor:
    """h int64 in [0, 2^32) -> G int64 = floor(2^18 * -ln(-ln u)) up to the rounding of the steps,
    u = (h + 1/2) / 2^32. With a = 2h + 1, u = a / 2^33 and d = 2^33 - a, 1 - u = d / 2^33:
    body (d >= 2^25): E = -ln u = (33 - k_a) ln 2 - f_a >= 2^-8, g = -ln E = (30 - k_E) ln 2 - f_E;
    tail (d < 2^25, E < 2^-8 would lose relative precision): with w = 1 - u, -ln u = w R(w) and
    g = 33 ln 2 - ln d - ln R(w), ln R(w) = w/2 + 5 w^2/24 + w^3/8 + O(w^4)."""
    a = 2 * h + 1
    d = (1 << 33) - a
    tail = d < (1 << 25)
    k1, f1 = _log_parts(torch.where(tail, d, a))
    head = (33 - k1) * LN2_Q - f1  # body: E in Q30; tail: 33 ln 2 - ln d
    k2, f2 = _log_parts(head.clamp(min=1))
    body = (Q - k2) * LN2_Q - f2
    w = d >> 3  # Q30
    w2 = (w * w) >> Q
    w3 = (w2 * w) >> Q
    tail_g = head - ((w >> 1) + ((w2 * FIVE_24THS_Q) >> Q) + (w3 >> 3))
    return torch.where(tail, tail_g, body) >> G_SHIFT


def gumbel_from_fixed(big_g: torch.Tensor) -> torch.Tensor:
    """G int64 -> g = (2G + 1) * 2^-19 float32 (both steps exact)."""
    return (2 * big_g + 1).to(torch.float32) * GRID_HALF


def _top_p_cutoff(sorted_x: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """sorted_x [..., n] logits sorted descending -> [...] the smallest logit of the nucleus."""
    probs = torch.softmax(sorted_x / temperature, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    keep = (before < top_p).sum(-1, keepdim=True).clamp(min=1)
    return torch.gather(sorted_x, -1, keep - 1).squeeze(-1)


def sampling_cutoffs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """logits [B, N, V] -> cutoffs [B, N] float32 raw logits (-inf: no filter), on the logits' device.
    Selection runs on the logits in their own dtype and only the selected values are widened (rounding
    to float32 is monotone, so the cutoffs are those of the widened logits): no [B, N, V] float32 copy
    unless top-p without top-k has to sort the whole vocab."""
    cut = torch.full(logits.shape[:-1], float("-inf"), dtype=torch.float32, device=logits.device)
    vocab = logits.shape[-1]
    top = None
    if 0 < top_k < vocab:
        top = torch.topk(logits, top_k, dim=-1).values.float()  # sorted descending
        cut = top[..., -1]
    if top_p < 1.0 and vocab:
        sorted_x = top if top is not None else torch.sort(logits, dim=-1, descending=True).values.float()
        cut = torch.maximum(cut, _top_p_cutoff(sorted_x, temperature, top_p))
    return cut.contiguous()


@dataclass(frozen=True)
class Seeded:
    """Counter-based noise: g[b, n, v] is a function of (seed, offset, b, n, v) only (module docstring);
    seed and offset are ints in [0, 2^64)."""

    seed: int
    offset: int = 0


def stream_key_table(seed: int, offsets: int) -> torch.Tensor:
    """[offsets, 2] int32: stream_keys(seed, o) for o in 0..offsets-1, bit-cast to signed int32, for a
    caller that picks the offset of each draw on the device (a CUDA graph replayed once per draw).
    Every offset at once (stream_keys' chain over int64 tensors): an engine call builds one table."""
    check_seed_range(seed, max(offsets - 1, 0))
    k0, k1 = _stream_chain(seed, torch.arange(offsets, dtype=torch.int64))
    table = torch.stack([k0, k1], dim=1)
    return torch.where(table >= 1 << 31, table - (1 << 32), table).to(torch.int32)


def seeded_noise(batch: int, nodes: int, vocab: int, seeded: Seeded) -> torch.Tensor:
    """The seeded Gumbel noise materialized [B, N, V] float32 (CPU): what Seeded stands for."""
    r0, r1 = row_keys(seeded.seed, seeded.offset, batch, nodes)
    return gumbel_from_fixed(gumbel_fixed(hash_bits(r0, r1, vocab)))


def _argmax_scores(x: np.ndarray, g: np.ndarray, cut: np.ndarray, t: np.float32) -> np.ndarray:
    """x, g [..., V] float32, cut [...] -> argmax_v [x_v >= cut] (x_v / t + g_v), first on ties."""
    score = np.where(x >= cut[..., None], x / t + g, np.float32(-np.inf))
    return np.argmax(score, axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], np.int64)


def sample_tokens(logits: torch.Tensor, noise, cutoffs: torch.Tensor, temperature: float):
    """logits [B, N, V] float, noise [B, N, V] float32 or Seeded, cutoffs [B, N] float32 -> tokens
    [B, N] int64. Seeded noise is generated a few requests at a time (about SEEDED_CHUNK elements)."""
    x = logits.detach().to("cpu", torch.float32).numpy()
    cut = cutoffs.detach().to("cpu", torch.float32).numpy()
    t = np.float32(float32_temperature(temperature))
    if isinstance(noise, Seeded):
        batch, nodes, vocab = x.shape
        r0, r1 = row_keys(noise.seed, noise.offset, batch, nodes)
        step = max(1, SEEDED_CHUNK // max(1, nodes * vocab))
        tokens = np.zeros((batch, nodes), np.int64)
        for b in range(0, batch, step):
            g = gumbel_from_fixed(gumbel_fixed(hash_bits(r0[b : b + step], r1[b : b + step], vocab)))
            tokens[b : b + step] = _argmax_scores(x[b : b + step], g.numpy(), cut[b : b + step], t)
    else:
        tokens = _argmax_scores(x, noise.detach().to("cpu", torch.float32).numpy(), cut, t)
    return torch.from_numpy(tokens.astype(np.int64)).to(logits.device)


def accept_sampled(
    tree: DraftTree, logits: torch.Tensor, noise, cutoffs: torch.Tensor, temperature: float
) -> tuple[AcceptResult, torch.Tensor]:
    """Sample the target's token at every node (sample_tokens; noise a tensor or Seeded), then walk as
    greedy accept does. Returns (AcceptResult, sampled tokens [B, N] int64)."""
    sampled = sample_tokens(logits, noise, cutoffs, temperature)
    return ref_tree.accept_greedy(tree, sampled), sampled
