"""The configuration of a drafter training run (`kdtree-engine train drafter`), checked when it is made:
a bad value raises ValueError naming the field (`DrafterTrainConfig.<field>: ...`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtree_engine.train.drafter_pool import PoolSpec

__all__ = ["DrafterTrainConfig", "require"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def require(ok: bool, name: str, message: str) -> None:
    """ValueError `DrafterTrainConfig.<name>: <message>` unless ok (also for the checks of the files a
    config names, made when a run starts)."""
    if not ok:
        raise ValueError(f"DrafterTrainConfig.{name}: {message}")


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
_POSITIVE_FLOATS = ("lr", "gamma", "grad_clip", "checkpoint_every_s")


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
        self._check_ranges()
        self._check_shape()
        self._within("sampled_fraction", 0, 1)
        self._check_budget()
        self._check_layer_ids()

    def pool_spec(self, sequences: int | None = None) -> PoolSpec:
        """The train pool (or, with `sequences`, a pool of that size built the same way)."""
        return PoolSpec(
            sequences=self.pool_sequences if sequences is None else sequences,
            prompt_len=self.prompt_len,
            new_tokens=self.new_tokens,
            sampled_fraction=self.sampled_fraction,
            batch=self.pool_batch,
        )

    # The checks, in the order a config with several bad values reports them.

    def _at_least(self, name: str, least, why: str = "") -> None:
        value = getattr(self, name)
        require(value >= least, name, f"expected >= {least}{why}, got {value}")

    def _above(self, name: str, bound) -> None:
        value = getattr(self, name)
        require(value > bound, name, f"expected > {bound}, got {value}")

    def _within(self, name: str, lo, hi) -> None:
        value = getattr(self, name)
        require(lo <= value <= hi, name, f"expected in [{lo}, {hi}], got {value}")

    def _check_ranges(self) -> None:
        """The sizes, rates and schedule fields on their own."""
        for name in _POSITIVE_INTS:
            self._at_least(name, 1)
        for name in _POSITIVE_FLOATS:
            self._above(name, 0)
        self._at_least("weight_decay", 0)
        self._at_least("warmup_steps", 0)
        self._within("min_lr_ratio", 0, 1)
        self._at_least("block_size", 2, " (bonus + L)")

    def _check_shape(self) -> None:
        """The drafter's attention shape, and room for one block in a pooled continuation."""
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        require(
            heads % kv_heads == 0,
            "num_key_value_heads",
            f"{kv_heads} does not divide num_attention_heads {heads}",
        )
        require(self.head_dim % 2 == 0, "head_dim", f"expected even (rope), got {self.head_dim}")
        least = self.block_size - 1
        require(
            self.new_tokens >= least,
            "new_tokens",
            f"expected >= block_size - 1 = {least} (room for one block), got {self.new_tokens}",
        )

    def _check_budget(self) -> None:
        """max_steps, minutes or both, each positive when given."""
        require(
            self.minutes is not None or self.max_steps is not None,
            "max_steps",
            "give max_steps or minutes (or both)",
        )
        if self.minutes is not None:
            self._above("minutes", 0)
        if self.max_steps is not None:
            self._at_least("max_steps", 1)

    def _check_layer_ids(self) -> None:
        """Explicit target layer ids: some, none negative (the target's layer count is checked when the
        target is loaded, by new_drafter)."""
        if self.target_layer_ids is not None:
            ids = self.target_layer_ids
            require(bool(ids) and min(ids) >= 0, "target_layer_ids", f"expected ids >= 0, got {ids}")
