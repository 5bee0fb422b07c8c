"""DFlash drafter configuration, read from the published checkpoints' config.json (a Qwen3 config plus
`block_size`, `num_target_layers` and a `dflash_config` dict with `target_layer_ids` and `mask_token_id`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kdtree_engine.model.config import read_json


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The official default when a checkpoint names no `target_layer_ids`: evenly spaced target layers
    from 1 to num_target_layers - 3 (one id per drafter layer), or the middle layer for a 1-layer drafter."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter: `num_hidden_layers` Qwen3-style layers drafting `block_size - 1` tokens per
    forward (the block is [bonus, MASK x (block_size - 1)])."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_target_layers",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DFlashConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size: expected >= 2 (bonus + L), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("DFlashConfig.num_key_value_heads: must divide num_attention_heads")
        if self.head_dim % 2:
            raise ValueError(f"DFlashConfig.head_dim: expected even (rope), got {self.head_dim}")
        if not self.target_layer_ids:
            raise ValueError("DFlashConfig.target_layer_ids: expected at least one target layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DFlashConfig.mask_token_id: expected in [0, {self.vocab_size}), got {self.mask_token_id}"
            )

    @property
    def draft_len(self) -> int:
        """L, the number of drafted positions (the depth limit of a DDTree)."""
        return self.block_size - 1

    @classmethod
    def from_hf_dict(cls, d: dict) -> DFlashConfig:
        dflash = d.get("dflash_config") or {}
        layers = int(d["num_hidden_layers"])
        num_target = int(d.get("num_target_layers", 0) or 0)
        ids = dflash.get("target_layer_ids") or build_target_layer_ids(num_target, layers)
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("config: dflash_config.mask_token_id is missing")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"config: rope scaling {rope!r} is not supported by the DFlash drafter")
        if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ()):
            raise ValueError("config: sliding-window drafter layers are not supported")
        heads = int(d["num_attention_heads"])
        known = set(cls.__dataclass_fields__)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            block_size=int(d["block_size"]),
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(mask),
            num_target_layers=num_target or max(ids) + 1,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_json(cls, path: str | Path) -> DFlashConfig:
        """ValueError naming the file for broken JSON, a missing field or a field of the wrong type."""
        d = read_json(path)
        try:
            return cls.from_hf_dict(d)
        except KeyError as exc:
            raise ValueError(f"{path}: missing required field {exc}") from None
        except (TypeError, AttributeError) as exc:  # e.g. "hidden_size": [64], a string as a dict
            raise ValueError(f"{path}: unexpected value in the config ({type(exc).__name__}: {exc})") from exc

    def to_hf_dict(self) -> dict:
        """The published layout (Qwen3 fields + DFlash fields), suitable for config.json."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "target_layer_ids", "mask_token_id")}
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_act="silu",
            tie_word_embeddings=False,
            dflash_config={
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        )
        return d


def tiny_drafter_config(target_config, **overrides) -> DFlashConfig:
    """A tiny drafter matching `target_config` (a kdtree_engine.model ModelConfig): same vocab and
    hidden size, 2 layers, block_size 8, reading two target layers, mask = last token id."""
    n = int(target_config.num_hidden_layers)
    ids = (0, n - 1) if n > 1 else (0,)
    cfg = DFlashConfig(
        vocab_size=int(target_config.vocab_size),
        hidden_size=int(target_config.hidden_size),
        intermediate_size=2 * int(target_config.hidden_size),
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        block_size=8,
        target_layer_ids=ids,
        mask_token_id=int(target_config.vocab_size) - 1,
        num_target_layers=n,
    )
    return replace(cfg, **overrides)
