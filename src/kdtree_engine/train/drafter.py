"""Training a DFlash drafter for a target model on the target's own predictions (our recipe: no
official DFlash training code is published).

Data. A pool of sequences: seeded random windows of `prompt_len` tokens of train.bin, each continued by
the TARGET for `new_tokens` tokens (argmax, or a fraction sampled at temperature 1), so the drafter
learns what the target will verify. Every pooled sequence then goes through one target forward that
captures the drafter's `target_layer_ids`: the features X [S, F] are exactly the tensor the engine hands
the drafter as `context` (the concatenated outputs of those decoder layers, see engine/loop.py).

Training forward. For a sequence x[0..S) and an anchor a (prompt_len - 1 <= a <= S - 1 - L, L =
block_size - 1), the block [x_a, MASK x L] at positions a..a+L attends to the context rows r < a
(hidden_norm(fc(X_r)) roped at r) and bidirectionally to its own rows, as DFlashDrafter.forward does at
a round whose bonus token is x_a. Its L outputs predict x[a+1..a+L]; the cross-entropy of position k is
weighted by exp(-(k - 1) / gamma): the early positions decide how much of a chain is accepted. All the
blocks of a batch run together: one attention call per layer over keys [S context rows | all block
rows] with a boolean mask, through the drafter's own submodules, so the parameters trained are exactly
those inference uses (`training_logits` equals `DFlashDrafter.draft`, checked by the tests).

Dimension names: B sequences, S = prompt_len + new_tokens rows, A anchors per sequence, T = block_size =
L + 1, H target hidden, F = len(target_layer_ids) * H, V vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kdtree_engine.drafter import (
    DFlashConfig,
    DFlashDrafter,
    build_target_layer_ids,
    load_drafter,
    save_drafter,
)
from kdtree_engine.train.data import load_tokens, read_manifest
from kdtree_engine.train.schedule import pyplot, warmup_cosine

__all__ = [
    "Batch",
    "DrafterTrainConfig",
    "HeldoutMetrics",
    "Pool",
    "PoolSpec",
    "block_labels",
    "build_pool",
    "check_inputs",
    "chain_acceptance",
    "continue_prompts",
    "dflash_loss",
    "evaluate",
    "learning_rate",
    "loss_weights",
    "new_drafter",
    "plot_losses",
    "sample_anchors",
    "sample_windows",
    "target_features",
    "train_drafter",
    "train_step",
    "training_logits",
]

MANIFEST_KEYS = ("eos_token_id", "mask_token_id", "vocab_size")
STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.json"
PLOT_FILE = "loss.png"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DrafterTrainConfig:
    """One drafter training run. target: a HF-style target folder (load_model); data: a folder with
    train.bin / heldout.bin (flat uint16 token ids) and manifest.json (eos_token_id, mask_token_id,
    vocab_size); out: where the drafter, trainer_state.pt, train_log.json and loss.png go.

    The drafter's hidden and vocabulary sizes are the target's; target_layer_ids None means
    build_target_layer_ids(target layers, num_hidden_layers). Training stops at max_steps or after
    `minutes` of training (the pool build not counted; across resumed runs), whichever comes first.
    lr: linear warmup over warmup_steps, then cosine down to min_lr_ratio * lr over the rest of the
    budget. The pool: pool_sequences windows of prompt_len tokens continued by new_tokens target tokens,
    sampled_fraction of them sampled at temperature 1 (the rest greedy), pool_batch rows per target
    forward; the held-out pool is built the same way from heldout.bin with heldout_sequences rows and
    evaluated every eval_every steps and at the end."""

    target: str = "out/kimi-nano"
    data: str = "data/kimi-nano"
    out: str = "out/kimi-nano-dflash"
    num_hidden_layers: int = 3
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    seed: int = 0
    minutes: float | None = None
    max_steps: int | None = 2000
    batch_size: int = 64
    anchors_per_seq: int = 16
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    pool_sequences: int = 4096
    prompt_len: int = 64
    new_tokens: int = 192
    sampled_fraction: float = 0.25
    pool_batch: int = 512
    heldout_sequences: int = 256
    eval_every: int = 250
    device: str | None = None  # None: cuda when available, else cpu
    checkpoint_every_s: float = 600.0
    resume: bool = False

    def __post_init__(self) -> None:
        if self.device is None:
            object.__setattr__(self, "device", _default_device())
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in _POSITIVE_INTS:
            _require(int(getattr(self, name)) >= 1, name, f"expected >= 1, got {getattr(self, name)}")
        for name in ("lr", "gamma", "grad_clip", "checkpoint_every_s"):
            _require(getattr(self, name) > 0, name, f"expected > 0, got {getattr(self, name)}")
        _require(self.weight_decay >= 0, "weight_decay", f"expected >= 0, got {self.weight_decay}")
        _require(self.warmup_steps >= 0, "warmup_steps", f"expected >= 0, got {self.warmup_steps}")
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"expected in [0, 1], got {self.min_lr_ratio}")
        _require(self.block_size >= 2, "block_size", f"expected >= 2 (bonus + L), got {self.block_size}")
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
        )
        _require(self.head_dim % 2 == 0, "head_dim", f"expected even (rope), got {self.head_dim}")
        _require(
            self.new_tokens >= self.block_size - 1,
            "new_tokens",
            f"expected >= block_size - 1 = {self.block_size - 1} (room for one block), got {self.new_tokens}",
        )
        _require(
            0 <= self.sampled_fraction <= 1,
            "sampled_fraction",
            f"expected in [0, 1], got {self.sampled_fraction}",
        )
        self._check_budget()
        if self.target_layer_ids is not None:
            ids = self.target_layer_ids
            _require(bool(ids) and min(ids) >= 0, "target_layer_ids", f"expected ids >= 0, got {ids}")

    def _check_budget(self) -> None:
        _require(
            self.minutes is not None or self.max_steps is not None,
            "max_steps",
            "give max_steps or minutes (or both)",
        )
        if self.minutes is not None:
            _require(self.minutes > 0, "minutes", f"expected > 0, got {self.minutes}")
        if self.max_steps is not None:
            _require(self.max_steps >= 1, "max_steps", f"expected >= 1, got {self.max_steps}")

    def pool_spec(self, sequences: int | None = None) -> PoolSpec:
        """The train pool (or, with `sequences`, a pool of that size built the same way)."""
        return PoolSpec(
            sequences=self.pool_sequences if sequences is None else sequences,
            prompt_len=self.prompt_len,
            new_tokens=self.new_tokens,
            sampled_fraction=self.sampled_fraction,
            batch=self.pool_batch,
        )


_POSITIVE_INTS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "batch_size",
    "anchors_per_seq",
    "pool_sequences",
    "prompt_len",
    "new_tokens",
    "pool_batch",
    "heldout_sequences",
    "eval_every",
)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"DrafterTrainConfig.{name}: {message}")


# ----------------------------------------------------------------------------------------------- pool


@dataclass(frozen=True)
class PoolSpec:
    """How a pool is built: `sequences` windows of `prompt_len` source tokens, each continued by the
    target for `new_tokens` tokens; the first round(sampled_fraction * sequences) rows are sampled at
    temperature 1, the others greedy; `batch` rows per target forward."""

    sequences: int
    prompt_len: int
    new_tokens: int
    sampled_fraction: float = 0.0
    batch: int = 512

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def num_sampled(self) -> int:
        return int(round(self.sequences * self.sampled_fraction))


@dataclass
class Pool:
    """tokens [N, S] int64 and features [N, S, F] (the target's captured layers, its dtype) on the
    device; rows >= prompt_len of tokens are the target's own continuation."""

    tokens: torch.Tensor
    features: torch.Tensor
    prompt_len: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


def sample_windows(source: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`count` windows of `length` consecutive tokens of `source` at seeded random offsets (they may
    cross document boundaries, as the target saw in training) -> [count, length] int64."""
    if len(source) < length:
        raise ValueError(f"source: {len(source)} tokens, fewer than one window of {length}")
    starts = rng.integers(0, len(source) - length + 1, size=count)
    return np.asarray(source[starts[:, None] + np.arange(length)], dtype=np.int64)


def _next_tokens(logits: torch.Tensor, sampled: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """logits [b, V] -> [b] argmax, or for rows with sampled[b] a draw at temperature 1."""
    greedy = logits.argmax(-1)
    if sampled is None:
        return greedy
    drawn = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen)[:, 0]
    return torch.where(sampled, drawn, greedy)


@torch.no_grad()
def continue_prompts(
    target, prompts: torch.Tensor, new_tokens: int, sampled: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """prompts [b, P] int64 on the target's device -> [b, P + new_tokens]: each row continued by the
    target on its latent cache (one prefill, then one decode forward per token), greedy or, where
    sampled [b] bool, at temperature 1 with `gen` (a generator on the target's device)."""
    b, p = prompts.shape
    cache = target.new_cache(b, p + new_tokens)
    last = torch.full((b,), p - 1, dtype=torch.int64, device=prompts.device)
    logits = target(prompts, cache, logits_rows=last, validate=False).logits[:, 0]
    sampled = sampled if bool(sampled.any()) else None
    out = [prompts]
    for i in range(new_tokens):
        token = _next_tokens(logits, sampled, gen)
        out.append(token[:, None])
        if i + 1 < new_tokens:
            logits = target(token[:, None], cache, validate=False).logits[:, -1]
    return torch.cat(out, dim=1)


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """tokens [b, S] -> the drafter's context features [b, S, F]: one target forward over the whole
    sequence capturing `layers` (the same tensor the engine passes the drafter as `context`)."""
    b, s = tokens.shape
    cache = target.new_cache(b, s)
    first = torch.zeros(b, dtype=torch.int64, device=tokens.device)  # skip the [b, S, V] projection
    out = target(tokens, cache, capture_layers=layers, logits_rows=first, validate=False)
    return out.hidden


def build_pool(
    target, source: np.ndarray, spec: PoolSpec, layers: tuple[int, ...], seed: int, progress: bool = True
) -> Pool:
    """The seeded pool of `spec` from `source` (a uint16 token array): windows, target continuations,
    target features, `spec.batch` rows at a time, kept on the target's device."""
    from tqdm import tqdm

    windows = sample_windows(source, spec.sequences, spec.prompt_len, np.random.default_rng(seed))
    vocab = target.config.vocab_size
    if windows.size and int(windows.max()) >= vocab:
        raise ValueError(f"source: token id {int(windows.max())} outside the target vocabulary ({vocab})")
    dev = target.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    sampled = torch.arange(spec.sequences, device=dev) < spec.num_sampled
    tokens, features = [], []
    chunks = range(0, spec.sequences, spec.batch)
    for lo in tqdm(chunks, desc="pool", disable=not progress, leave=False):
        hi = min(lo + spec.batch, spec.sequences)
        prompts = torch.from_numpy(windows[lo:hi]).to(dev)
        seqs = continue_prompts(target, prompts, spec.new_tokens, sampled[lo:hi], gen)
        tokens.append(seqs)
        features.append(target_features(target, seqs, layers))
    return Pool(torch.cat(tokens), torch.cat(features), spec.prompt_len)


# ----------------------------------------------------------------------------------- training forward


def _block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> [B, A*T, S + A*T] bool: a row of block j sees the context rows r < anchors[j]
    and every row of block j (bidirectional), nothing of the other blocks."""
    b, a = anchors.shape
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, A, S]
    ctx = ctx[:, :, None, :].expand(b, a, block_size, seq_len).reshape(b, a * block_size, seq_len)
    block_of = torch.arange(a * block_size, device=dev) // block_size
    same = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, A*T, A*T]
    return torch.cat([ctx, same], dim=2)


def _masked_layer(layer, x, ctx, block_rope, ctx_rope, mask) -> torch.Tensor:
    """DFlashLayer.forward for many blocks at once, without a cache: keys [context rows | block rows]."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q = attn.queries(h, *block_rope)
    k_blk, v_blk = attn.keys_values(h, *block_rope)
    k_ctx, v_ctx = attn.keys_values(ctx, *ctx_rope)
    k, v = torch.cat([k_ctx, k_blk], dim=1), torch.cat([v_ctx, v_blk], dim=1)
    x = x + attn.attend(q, k, v, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int) -> torch.Tensor:
    """[B, A, T] int64: [x_a, MASK x L] per anchor."""
    block = anchors.new_full((*anchors.shape, block_size), mask_id)
    block[..., 0] = tokens.gather(1, anchors)
    return block


def training_logits(
    drafter: DFlashDrafter, target, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """tokens [B, S] int64, features [B, S, F] (target_features), anchors [B, A] int64 in
    [0, S - 1 - L] -> draft logits [B, A, L, V] float32 of positions a + 1 .. a + L, with gradients to
    the drafter's parameters. Block j equals DFlashDrafter.draft with context rows < anchors[:, j],
    bonus x[anchors[:, j]] at start anchors[:, j]. The target's embed_tokens / lm_head are used as
    they are (freeze them with requires_grad_(False))."""
    cfg = drafter.config
    b, s = tokens.shape
    a, t = anchors.shape[1], cfg.block_size
    dtype = drafter.fc.weight.dtype
    dev = tokens.device
    ctx = drafter.hidden_norm(drafter.fc(features.to(dtype)))  # [B, S, H]
    block = _blocks(tokens, anchors, t, cfg.mask_token_id).view(b, a * t)
    x = target.embed_tokens(block).to(dtype)  # [B, A*T, H]
    blk_pos = (anchors[:, :, None] + torch.arange(t, device=dev)).view(b, a * t)
    ctx_pos = torch.arange(s, device=dev).expand(b, s)
    block_rope, ctx_rope = drafter._rope(blk_pos, dtype), drafter._rope(ctx_pos, dtype)
    mask = _block_mask(anchors, s, t)
    for layer in drafter.layers:
        x = _masked_layer(layer, x, ctx, block_rope, ctx_rope, mask)
    hidden = drafter.norm(x).view(b, a, t, -1)[:, :, 1:]  # [B, A, L, H]
    lm_head = target.lm_head
    return lm_head(hidden.to(lm_head.weight.dtype)).float()


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, draft_len: int) -> torch.Tensor:
    """tokens [B, S], anchors [B, A] -> the targets x[a + 1 .. a + L] of every block [B, A, L]."""
    b, a = anchors.shape
    idx = anchors[:, :, None] + torch.arange(1, draft_len + 1, device=anchors.device)
    return tokens.gather(1, idx.view(b, a * draft_len)).view(b, a, draft_len)


def loss_weights(draft_len: int, gamma: float, device=None) -> torch.Tensor:
    """[L] float32: w_k = exp(-(k - 1) / gamma) for block positions k = 1 .. L (not normalized)."""
    k = torch.arange(draft_len, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """logits [B, A, L, V], labels [B, A, L] -> sum_k w_k * mean cross-entropy at position k / sum_k w_k
    (a float32 scalar)."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    per_position = ce.view(labels.shape).flatten(0, -2).mean(0)  # [L]
    w = loss_weights(labels.shape[-1], gamma, device=logits.device)
    return (per_position * w).sum() / w.sum()


def chain_acceptance(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, A] float32: 1 + the number of leading block positions whose argmax is the label, i.e. the
    tokens a greedy DFlash chain would commit per round on this block (the bonus token included)."""
    hits = (logits.argmax(-1) == labels).long()  # [B, A, L]
    return 1.0 + hits.cumprod(dim=-1).sum(-1).float()


def sample_anchors(batch: int, count: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, count] int64 anchors in [lo, hi] (CPU), distinct within a row when count <= hi - lo + 1."""
    span = hi - lo + 1
    if span < 1:
        raise ValueError(f"anchors: empty range [{lo}, {hi}]")
    if count <= span:
        return torch.rand(batch, span, generator=gen).argsort(dim=1)[:, :count] + lo
    return torch.randint(lo, hi + 1, (batch, count), generator=gen)


def _anchor_range(pool: Pool, block_size: int) -> tuple[int, int]:
    """The allowed anchors: from the last prompt token to the last one with a full block of labels."""
    return pool.prompt_len - 1, pool.seq_len - block_size


@dataclass
class Batch:
    """tokens [B, S], features [B, S, F], anchors [B, A]: one training (or evaluation) batch."""

    tokens: torch.Tensor
    features: torch.Tensor
    anchors: torch.Tensor

    def labels(self, draft_len: int) -> torch.Tensor:
        return block_labels(self.tokens, self.anchors, draft_len)


def _random_batch(pool: Pool, batch: int, anchors: int, block_size: int, gen: torch.Generator) -> Batch:
    """Rows drawn with replacement, `anchors` random anchors each (indices drawn on the CPU by `gen`)."""
    rows = torch.randint(len(pool), (batch,), generator=gen)
    lo, hi = _anchor_range(pool, block_size)
    anch = sample_anchors(batch, anchors, lo, hi, gen)
    dev = pool.tokens.device
    rows = rows.to(dev)
    return Batch(pool.tokens[rows], pool.features[rows], anch.to(dev))


def _autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master parameters); plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    drafter: DFlashDrafter, target, batch: Batch, optimizer, gamma: float, grad_clip: float
) -> torch.Tensor:
    """One optimizer step on `batch`; returns the loss (a detached device scalar: no host sync)."""
    with _autocast(batch.tokens.device):
        logits = training_logits(drafter, target, batch.tokens, batch.features, batch.anchors)
        loss = dflash_loss(logits, batch.labels(drafter.config.draft_len), gamma)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    optimizer.step()
    return loss.detach()


@dataclass(frozen=True)
class HeldoutMetrics:
    """loss: dflash_loss over the held-out blocks; acceptance: mean chain_acceptance."""

    loss: float
    acceptance: float


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter, target, pool: Pool, anchors: torch.Tensor, gamma: float, batch_size: int
) -> HeldoutMetrics:
    """The held-out metrics of every pool row with its fixed anchors [N, A], `batch_size` rows at a time."""
    draft_len = drafter.config.draft_len
    per_pos = torch.zeros(draft_len, dtype=torch.float64, device=pool.tokens.device)
    accepted = 0.0
    for lo in range(0, len(pool), batch_size):
        rows = slice(lo, lo + batch_size)
        batch = Batch(pool.tokens[rows], pool.features[rows], anchors[rows])
        labels = batch.labels(draft_len)
        with _autocast(batch.tokens.device):
            logits = training_logits(drafter, target, batch.tokens, batch.features, batch.anchors)
        ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        per_pos += ce.view(-1, draft_len).sum(0).double()
        accepted += float(chain_acceptance(logits, labels).sum())
    blocks = anchors.numel()
    w = loss_weights(draft_len, gamma, device=per_pos.device).double()
    loss = float((per_pos / blocks * w).sum() / w.sum())
    return HeldoutMetrics(loss=loss, acceptance=accepted / blocks)


def learning_rate(cfg: DrafterTrainConfig, step: int, seconds: float = 0.0) -> float:
    """The lr of optimizer step `step` (0-based): linear warmup over cfg.warmup_steps, then cosine from
    cfg.lr to min_lr_ratio * cfg.lr over the rest of the budget: the steps after warmup up to
    max_steps, or the fraction of `minutes` spent (`seconds` of training), whichever is further."""
    progress = 0.0
    if cfg.max_steps is not None:
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.minutes is not None:
        progress = max(progress, seconds / (60.0 * cfg.minutes))
    return warmup_cosine(cfg.lr, step, cfg.warmup_steps, progress, cfg.min_lr_ratio)


# ------------------------------------------------------------------------------------------ the run


def _read_manifest(data: Path) -> dict:
    """manifest.json of the data folder; ValueError naming the field when a needed key is missing."""
    path = data / "manifest.json"
    try:
        manifest = read_manifest(data)
    except (ValueError, OSError) as exc:  # missing, or broken JSON (json's error is a ValueError)
        raise ValueError(f"DrafterTrainConfig.data: cannot read {path} ({exc})") from None
    missing = [k for k in MANIFEST_KEYS if not isinstance(manifest.get(k), int)]
    if missing:
        raise ValueError(f"DrafterTrainConfig.data: {path} has no integer {missing}")
    return manifest


def check_inputs(cfg: DrafterTrainConfig) -> dict:
    """The file-system checks (before anything is loaded); returns the manifest."""
    data, target = Path(cfg.data), Path(cfg.target)
    _require(data.is_dir(), "data", f"{data} is not a folder")
    for name in ("train.bin", "heldout.bin"):
        size = (data / name).stat().st_size if (data / name).is_file() else 0
        _require(size >= 2 * cfg.prompt_len, "data", f"{data / name} is missing or shorter than prompt_len")
    _require((target / "config.json").is_file(), "target", f"no config.json in {target}")
    if cfg.resume:
        _require((Path(cfg.out) / STATE_FILE).is_file(), "resume", f"no {STATE_FILE} in {cfg.out}")
    _require(cfg.device != "cuda" or torch.cuda.is_available(), "device", "cuda is not available")
    return _read_manifest(data)


def new_drafter(cfg: DrafterTrainConfig, target_config, mask_token_id: int) -> DFlashDrafter:
    """A freshly initialized float32 drafter of cfg's shape for a target of `target_config` (hidden and
    vocabulary sizes, layer count); ValueError naming the field for ids outside the target."""
    n = int(target_config.num_hidden_layers)
    ids = cfg.target_layer_ids or build_target_layer_ids(n, cfg.num_hidden_layers)
    _require(max(ids) < n, "target_layer_ids", f"{ids} outside the target's {n} layers")
    vocab = int(target_config.vocab_size)
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"DrafterTrainConfig.data: mask_token_id {mask_token_id} outside vocab {vocab}")
    config = DFlashConfig(
        vocab_size=vocab,
        hidden_size=int(target_config.hidden_size),
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        block_size=cfg.block_size,
        target_layer_ids=tuple(ids),
        mask_token_id=mask_token_id,
        num_target_layers=n,
        rms_norm_eps=float(target_config.rms_norm_eps),
        max_position_embeddings=int(target_config.max_position_embeddings),
    )
    return DFlashDrafter(config).float()


def _optimizer(drafter: DFlashDrafter, cfg: DrafterTrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices only (not on the norm weights)."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class _Run:
    """What a run carries between steps and checkpoints."""

    cfg: DrafterTrainConfig
    drafter: DFlashDrafter
    target: object
    optimizer: torch.optim.AdamW
    gen: torch.Generator  # batch rows and anchors (CPU)
    pool_seed: int
    step: int = 0
    seconds: float = 0.0  # training wall time, all runs together
    log: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def done(self) -> bool:
        cfg = self.cfg
        by_steps = cfg.max_steps is not None and self.step >= cfg.max_steps
        by_time = cfg.minutes is not None and self.seconds >= 60.0 * cfg.minutes
        return by_steps or by_time


def _new_log(cfg: DrafterTrainConfig, drafter: DFlashDrafter) -> dict:
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "drafter": drafter.config.to_hf_dict(),
        "pool": {},
        "steps": [],
        "heldout": [],
    }


def _save_state(run: _Run) -> None:
    state = {
        "step": run.step,
        "seconds": run.seconds,
        "pool_seed": run.pool_seed,
        "optimizer": run.optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "batch_rng": run.gen.get_state(),
        "drafter": run.drafter.config.to_hf_dict(),
    }
    tmp = run.out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run.out / STATE_FILE)


def _checkpoint(run: _Run) -> None:
    """The drafter (published layout), trainer_state.pt, train_log.json and loss.png into cfg.out."""
    run.out.mkdir(parents=True, exist_ok=True)
    save_drafter(run.drafter, run.out)
    _save_state(run)
    (run.out / LOG_FILE).write_text(json.dumps(run.log, indent=1))
    plot_losses(run.log, run.out / PLOT_FILE)


def _restore(run: _Run) -> None:
    """Continues the run saved in cfg.out: weights, optimizer, step, time, RNG states, log, pool seed."""
    state = torch.load(run.out / STATE_FILE, map_location="cpu", weights_only=True)
    if state["drafter"] != run.drafter.config.to_hf_dict():
        raise ValueError(f"DrafterTrainConfig.resume: the drafter in {run.out} has another shape or target")
    saved = load_drafter(run.out, dtype=torch.float32, device=run.drafter.fc.weight.device)
    run.drafter.load_state_dict(saved.state_dict())
    run.optimizer.load_state_dict(state["optimizer"])
    run.step, run.seconds, run.pool_seed = (
        int(state["step"]),
        float(state["seconds"]),
        int(state["pool_seed"]),
    )
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    run.gen.set_state(state["batch_rng"])
    if (run.out / LOG_FILE).is_file():
        log = json.loads((run.out / LOG_FILE).read_text())
        log["steps"] = [r for r in log["steps"] if r["step"] <= run.step]
        log["heldout"] = [r for r in log["heldout"] if r["step"] <= run.step]
        run.log.update(steps=log["steps"], heldout=log["heldout"], pool=log.get("pool", {}))


def plot_losses(log: dict, path: Path) -> None:
    """loss.png: training loss per step, held-out loss and chain acceptance (skipped without
    matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = log["steps"]
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, label="train")
    held = log["heldout"]
    ax.plot([r["step"] for r in held], [r["loss"] for r in held], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="weighted cross-entropy", title="DFlash drafter loss")
    ax.legend()
    acc.plot([r["step"] for r in held], [r["acceptance"] for r in held], "o-")
    acc.set(xlabel="step", ylabel="tokens per round", title="held-out chain acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class _Pools:
    train: Pool
    heldout: Pool
    heldout_anchors: torch.Tensor  # [N, A] fixed, so evaluations compare


def _build_pools(run: _Run, data: Path) -> _Pools:
    cfg, layers = run.cfg, run.drafter.target_layer_ids
    t0 = time.monotonic()
    train = build_pool(run.target, load_tokens(data, "train"), cfg.pool_spec(), layers, run.pool_seed)
    held_spec = cfg.pool_spec(cfg.heldout_sequences)
    heldout = build_pool(run.target, load_tokens(data, "heldout"), held_spec, layers, run.pool_seed + 1)
    lo, hi = _anchor_range(heldout, cfg.block_size)
    gen = torch.Generator().manual_seed(run.pool_seed + 2)
    anchors = sample_anchors(len(heldout), cfg.anchors_per_seq, lo, hi, gen).to(heldout.tokens.device)
    run.log["pool"] = {
        "seed": run.pool_seed,
        "sequences": len(train),
        "heldout_sequences": len(heldout),
        "seq_len": train.seq_len,
        "seconds": round(time.monotonic() - t0, 3),
    }
    return _Pools(train, heldout, anchors)


def _evaluate(run: _Run, pools: _Pools) -> HeldoutMetrics:
    run.drafter.eval()
    m = evaluate(
        run.drafter, run.target, pools.heldout, pools.heldout_anchors, run.cfg.gamma, run.cfg.batch_size
    )
    run.drafter.train()
    run.log["heldout"].append(
        {"step": run.step, "loss": m.loss, "acceptance": m.acceptance, "time": round(run.seconds, 3)}
    )
    return m


def _train(run: _Run, pools: _Pools) -> None:
    """The step loop: stops at the step or time budget; checkpoints every checkpoint_every_s."""
    from tqdm import tqdm

    cfg = run.cfg
    positions = cfg.batch_size * cfg.anchors_per_seq * run.drafter.config.draft_len
    bar = tqdm(total=cfg.max_steps, initial=run.step, desc="train drafter", dynamic_ncols=True)
    start, start_seconds, start_step = time.monotonic(), run.seconds, run.step
    last_checkpoint = start
    run.drafter.train()
    while not run.done():
        lr = learning_rate(cfg, run.step, run.seconds)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        batch = _random_batch(pools.train, cfg.batch_size, cfg.anchors_per_seq, cfg.block_size, run.gen)
        loss = float(train_step(run.drafter, run.target, batch, run.optimizer, cfg.gamma, cfg.grad_clip))
        run.step += 1
        now = time.monotonic()
        run.seconds = start_seconds + now - start
        run.log["steps"].append({"step": run.step, "loss": loss, "lr": lr, "time": round(run.seconds, 3)})
        speed = positions * (run.step - start_step) / max(now - start, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{speed:.0f}")
        if run.step % cfg.eval_every == 0 and not run.done():
            m = _evaluate(run, pools)
            bar.write(f"step {run.step}: held-out loss {m.loss:.4f}, chain acceptance {m.acceptance:.3f}")
        if now - last_checkpoint >= cfg.checkpoint_every_s and not run.done():
            _checkpoint(run)
            last_checkpoint = time.monotonic()
    bar.close()


def train_drafter(cfg: DrafterTrainConfig) -> Path:
    """Trains a DFlash drafter for cfg.target (see the module docstring) and returns cfg.out, which then
    holds the drafter (load_drafter), trainer_state.pt, train_log.json and loss.png. With cfg.resume
    the run saved in cfg.out continues (same pool, optimizer and RNG states) up to cfg's budget."""
    manifest = check_inputs(cfg)
    _seed_everything(cfg.seed)
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from kdtree_engine.model import load_model

    target = load_model(cfg.target, dtype=dtype, device=device).requires_grad_(False)
    drafter = new_drafter(cfg, target.config, int(manifest["mask_token_id"])).to(device)
    run = _Run(
        cfg=cfg,
        drafter=drafter,
        target=target,
        optimizer=_optimizer(drafter, cfg),
        gen=torch.Generator().manual_seed(cfg.seed),
        pool_seed=cfg.seed,
    )
    run.log = _new_log(cfg, drafter)
    if cfg.resume:
        _restore(run)
    pools = _build_pools(run, Path(cfg.data))
    _train(run, pools)
    m = _evaluate(run, pools)
    print(f"step {run.step}: held-out loss {m.loss:.4f}, chain acceptance {m.acceptance:.3f}")
    _checkpoint(run)
    return run.out


HELP = {
    "target": "target model folder (kdtree-engine train target)",
    "data": "prepared corpus folder (kdtree-engine train data)",
    "out": "output drafter folder; checkpoints, train_log.json and loss.png are written there",
    "minutes": "wall-clock training budget (all resumed runs together); it stops with a checkpoint",
    "max_steps": "optimizer steps (the cosine schedule's length)",
    "batch_size": "pooled sequences per step",
    "anchors_per_seq": "blocks trained per sequence",
    "gamma": "loss weight of block position k: exp(-(k - 1) / gamma)",
    "pool_sequences": "target continuations in the training pool",
    "sampled_fraction": "fraction of the pool sampled at temperature 1 (the rest greedy)",
    "pool_batch": "rows per target forward while building the pool",
    "eval_every": "held-out evaluation every N steps",
    "resume": "continue from the checkpoint in --out",
    "device": "cuda or cpu (default: cuda when available)",
}


def add_arguments(parser) -> None:
    """The `kdtree-engine train drafter` options: one per scalar field of DrafterTrainConfig."""
    from kdtree_engine.train.options import add_config_arguments

    add_config_arguments(parser, DrafterTrainConfig, HELP)


def main(args) -> int:
    from kdtree_engine.train.options import config_from_args

    out = train_drafter(config_from_args(DrafterTrainConfig, args))
    print(f"DFlash drafter written to {out}")
    return 0
