"""ModelConfig: the DeepSeek-V3 / Kimi-K2 architecture read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ROPE_TYPES = ("default", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn magnitude correction (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DeepSeek-V3 / Kimi-K2 model; field names follow Hugging Face `config.json`.

    `rope_type` is "default" or "yarn"; the yarn fields mirror `rope_parameters` (or the legacy
    `rope_scaling`) of the checkpoint. `q_lora_rank` None means a plain `q_proj`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float | None = None
    rope_truncate: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v3"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    fp8_block_size: tuple[int, int] | None = None  # block-FP8 checkpoint (weight_scale_inv), loader only

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent cache: kv_lora_rank + qk_rope_head_dim (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2 under yarn, as transformers does."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_cos_sin_scale(self) -> float:
        """transformers' yarn `attention_factor`, applied to cos and sin (1.0 without yarn)."""
        if self.rope_type == "default":
            return 1.0
        if self.rope_attention_factor is not None:
            return float(self.rope_attention_factor)
        if self.rope_mscale and self.rope_mscale_all_dim:
            return float(
                yarn_mscale(self.rope_factor, self.rope_mscale)
                / yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            )
        return yarn_mscale(self.rope_factor)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config dict; raises ValueError naming an unsupported value."""
        return cls(**_fields_from_hf(d))

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """ValueError naming the file for broken JSON or a field of the wrong type."""
        d = read_json(path)
        try:
            return cls.from_hf_dict(d)
        except (TypeError, KeyError, AttributeError) as exc:  # e.g. "hidden_size": [64], a string as a dict
            raise ValueError(f"{path}: unexpected value in the config ({type(exc).__name__}: {exc})") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that transformers' DeepseekV3Config (and from_hf_dict) reads back."""
        d = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("rope_")
        }
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["num_key_value_heads"] = self.num_attention_heads
        d["rope_interleave"] = self.rope_interleave
        d["rope_parameters"] = self._rope_parameters()
        d["hidden_act"] = "silu"
        del d["fp8_block_size"]
        if self.fp8_block_size is not None:
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.fp8_block_size),
            }
        return d

    def _rope_parameters(self) -> dict[str, Any]:
        rp: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            rp.update(
                factor=self.rope_factor,
                original_max_position_embeddings=self.rope_original_max_position_embeddings,
                beta_fast=self.rope_beta_fast,
                beta_slow=self.rope_beta_slow,
                mscale=self.rope_mscale,
                mscale_all_dim=self.rope_mscale_all_dim,
                truncate=self.rope_truncate,
            )
            if self.rope_attention_factor is not None:
                rp["attention_factor"] = self.rope_attention_factor
        return rp


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file; ValueError naming the file and the position of a syntax
    error (a truncated download, a hand edit), or saying it is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    if not isinstance(d, dict):
        kind = {list: "array", str: "string", type(None): "null", bool: "boolean"}.get(type(d), "number")
        raise ValueError(f"{path}: expected a JSON object {{...}}, got a JSON {kind}")
    return d


def _require(d: dict[str, Any], key: str, default: Any = None, *, required: bool = True) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if required and default is None:
        raise ValueError(f"config: missing required field {key!r}")
    return default


def _check_supported(d: dict[str, Any]) -> None:
    model_type = d.get("model_type", "deepseek_v3")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config: model_type {model_type!r} is not supported (expected one of {MODEL_TYPES})"
        )
    checks = {
        "hidden_act": ("silu",),
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
    }
    for key, allowed in checks.items():
        if d.get(key) is not None and d[key] not in allowed:
            raise ValueError(f"config: {key}={d[key]!r} is not supported (expected one of {allowed})")
    _fp8_block_size(d)
    if d.get("moe_layer_freq", 1) not in (1, None):
        raise ValueError(f"config: moe_layer_freq={d['moe_layer_freq']!r} is not supported (expected 1)")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"config: pretraining_tp={d['pretraining_tp']!r} is not supported (expected 1)")


def _fp8_block_size(d: dict[str, Any]) -> tuple[int, int] | None:
    """DeepSeek's block-FP8 format (quant_method fp8, e4m3, weight_block_size); anything else refused."""
    q = d.get("quantization_config")
    if not q:
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
        raise ValueError(
            f"config: quantization_config {q!r} is not supported (only block fp8 e4m3 with weight_block_size)"
        )
    return int(block[0]), int(block[1])


def _rope_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Both spellings: `rope_parameters` (transformers >= 5) and the legacy `rope_scaling` + `rope_theta`."""
    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config: rope type {rope_type!r} is not supported (expected one of {ROPE_TYPES})")
    max_pos = int(d.get("max_position_embeddings", 4096))
    out: dict[str, Any] = {
        "rope_theta": float(rp.get("rope_theta", d.get("rope_theta", 10000.0))),
        "rope_type": rope_type,
        "max_position_embeddings": max_pos,
    }
    if rope_type == "yarn":
        orig = int(
            rp.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or max_pos
        )
        factor = rp.get("factor")
        out.update(
            rope_factor=float(factor if factor is not None else max_pos / orig),
            rope_original_max_position_embeddings=orig,
            rope_beta_fast=float(rp.get("beta_fast") or 32),
            rope_beta_slow=float(rp.get("beta_slow") or 1),
            rope_mscale=float(rp.get("mscale") or 0.0),
            rope_mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
            rope_attention_factor=rp.get("attention_factor"),
            rope_truncate=bool(rp.get("truncate", True)),
        )
    return out


def _fields_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    _check_supported(d)
    int_keys = (
        "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
        "num_attention_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
        "n_routed_experts num_experts_per_tok"
    ).split()
    f: dict[str, Any] = {k: int(_require(d, k)) for k in int_keys}
    q_lora = d.get("q_lora_rank")
    f["q_lora_rank"] = None if q_lora is None else int(q_lora)
    f["n_shared_experts"] = int(_require(d, "n_shared_experts", 0, required=False))
    f["n_group"] = int(_require(d, "n_group", 1, required=False))
    f["topk_group"] = int(_require(d, "topk_group", 1, required=False))
    f["first_k_dense_replace"] = int(_require(d, "first_k_dense_replace", 0, required=False))
    f["norm_topk_prob"] = bool(d.get("norm_topk_prob", True))
    f["routed_scaling_factor"] = float(_require(d, "routed_scaling_factor", 1.0, required=False))
    f["rms_norm_eps"] = float(_require(d, "rms_norm_eps", 1e-6, required=False))
    f["rope_interleave"] = bool(d.get("rope_interleave", True))
    f["attention_bias"] = bool(d.get("attention_bias", False))
    f["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    f["model_type"] = d.get("model_type", "deepseek_v3")
    f["bos_token_id"] = d.get("bos_token_id")
    f["eos_token_id"] = d.get("eos_token_id")
    f["fp8_block_size"] = _fp8_block_size(d)
    f.update(_rope_fields(d))
    return f


def _validate(c: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank")
    for name in positive:
        if getattr(c, name) <= 0:
            raise ValueError(f"config: {name} must be positive, got {getattr(c, name)}")
    if c.qk_rope_head_dim <= 0 or c.qk_rope_head_dim % 2:
        raise ValueError(f"config: qk_rope_head_dim must be positive and even, got {c.qk_rope_head_dim}")
    if c.q_lora_rank is not None and c.q_lora_rank <= 0:
        raise ValueError(f"config: q_lora_rank must be positive or null, got {c.q_lora_rank}")
    if c.first_k_dense_replace < c.num_hidden_layers:
        _validate_moe(c)
    if c.rope_type not in ROPE_TYPES:
        raise ValueError(f"config: rope_type {c.rope_type!r} is not supported (expected one of {ROPE_TYPES})")
    if c.model_type not in MODEL_TYPES:
        raise ValueError(
            f"config: model_type {c.model_type!r} is not supported (expected one of {MODEL_TYPES})"
        )


def _validate_moe(c: ModelConfig) -> None:
    if c.n_group <= 0 or c.n_routed_experts % c.n_group:
        raise ValueError(f"config: n_group={c.n_group} must divide n_routed_experts={c.n_routed_experts}")
    if not 0 < c.topk_group <= c.n_group:
        raise ValueError(f"config: topk_group={c.topk_group} must be in 1..n_group={c.n_group}")
    if c.n_routed_experts // c.n_group < 2:
        raise ValueError("config: each expert group needs >= 2 experts (group score = sum of its top 2)")
    if not 0 < c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts // c.n_group):
        raise ValueError(
            f"config: num_experts_per_tok={c.num_experts_per_tok} exceeds the experts in topk_group groups"
        )
