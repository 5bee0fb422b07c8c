"""Reference sampled accept (temperature > 0, top-k, top-p), defined so a GPU kernel can match it bit
for bit.

Every tree node draws its target token independently by the Gumbel-max trick:

    token = argmax_v [ x_v >= cutoff ]  ( x_v / T  +  g_v ),   ties -> the smaller id

with x the logits as float32, T the temperature rounded to float32, `x_v / T` a correctly rounded
float32 division, `+ g_v` a float32 add (no FMA can form: there is no multiply), g an explicit Gumbel
noise tensor [B, N, V] float32 (drawn from a torch.Generator, or given), and `cutoff` [B, N] a raw
float32 logit below which a token is excluded. Only comparisons, one division and one add touch the
logits, so the kernel and this reference agree exactly given the same noise and cutoffs.

The cutoff carries top-k and top-p (`sampling_cutoffs`): top-k keeps logits >= the k-th largest logit,
top-p then keeps the shortest run of largest logits whose renormalised tempered probability reaches
top_p. Logits tied with the cutoff are all kept. Top-p sums probabilities, so its cutoff can differ
by float rounding between devices when the mass sits within rounding of top_p; the public op computes
cutoffs once, on the logits' device, and both implementations consume the same cutoffs.
"""

from __future__ import annotations

import numpy as np
import torch

from kdtree_engine.ref import tree as ref_tree  # module import: ref.tree may still be initializing
from kdtree_engine.tree.types import AcceptResult, DraftTree


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


def _top_p_cutoff(sorted_x: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """sorted_x [..., n] logits sorted descending -> [...] the smallest logit of the nucleus."""
    probs = torch.softmax(sorted_x / temperature, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    keep = (before < top_p).sum(-1, keepdim=True).clamp(min=1)
    return torch.gather(sorted_x, -1, keep - 1).squeeze(-1)


def sampling_cutoffs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """logits [B, N, V] -> cutoffs [B, N] float32 raw logits (-inf: no filter), on the logits' device."""
    x = logits.float()
    cut = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        top = torch.topk(x, top_k, dim=-1).values  # sorted descending
        cut = top[..., -1]
    else:
        top = None
    if top_p < 1.0 and vocab:
        sorted_x = top if top is not None else torch.sort(x, dim=-1, descending=True).values
        cut = torch.maximum(cut, _top_p_cutoff(sorted_x, temperature, top_p))
    return cut.contiguous()


def sample_tokens(logits: torch.Tensor, noise: torch.Tensor, cutoffs: torch.Tensor, temperature: float):
    """logits [B, N, V] float, noise [B, N, V] float32, cutoffs [B, N] float32 -> tokens [B, N] int64."""
    x = logits.detach().to("cpu", torch.float32).numpy()
    g = noise.detach().to("cpu", torch.float32).numpy()
    cut = cutoffs.detach().to("cpu", torch.float32).numpy()
    t = np.float32(float32_temperature(temperature))
    score = np.where(x >= cut[..., None], x / t + g, np.float32(-np.inf))
    tokens = np.argmax(score, axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], np.int64)
    return torch.from_numpy(tokens.astype(np.int64)).to(logits.device)


def accept_sampled(
    tree: DraftTree, logits: torch.Tensor, noise: torch.Tensor, cutoffs: torch.Tensor, temperature: float
) -> tuple[AcceptResult, torch.Tensor]:
    """Sample the target's token at every node (sample_tokens), then walk as greedy accept does.
    Returns (AcceptResult, sampled tokens [B, N] int64)."""
    sampled = sample_tokens(logits, noise, cutoffs, temperature)
    return ref_tree.accept_greedy(tree, sampled), sampled
