"""Load a Hugging Face DeepSeek-V3 / Kimi-K2 checkpoint directory (config.json + safetensors)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kdtree_engine.model.config import ModelConfig, read_json
from kdtree_engine.model.model import DeepseekV3ForCausalLM

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LAYER = re.compile(r"^layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_dir(path: str | Path) -> Path:
    """path as a Path; FileNotFoundError naming it when it is not an existing directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path: {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"path: {path} is not a directory (pass the checkpoint directory)")
    return path


def index_shards(index: Path) -> list[str]:
    """The shard file names of a model.safetensors.index.json; ValueError naming the file if broken."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f'{index}: expected a "weight_map" object of tensor name -> shard file')
    return sorted(set(weight_map.values()))


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: the shards named by the index, or model.safetensors."""
    if (path / INDEX).is_file():
        files = [path / n for n in index_shards(path / INDEX)]
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
    else:
        raise FileNotFoundError(f"path: no {SINGLE} or {INDEX} in {path}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"path: shard {f.name} named in {INDEX} is missing from {path}")
    return files


def unreadable(file: Path, exc: Exception) -> ValueError:
    """The error for a safetensors file that cannot be read (truncated download, not safetensors)."""
    return ValueError(f"{file}: not a readable safetensors file ({exc}); is it truncated? download it again")


def skipped(config: ModelConfig, name: str) -> bool:
    """Tensors we do not load: layers >= num_hidden_layers (the MTP module) and rotary buffers."""
    key = name.removeprefix("model.")
    layer = _LAYER.match(key)
    return bool(layer and int(layer.group(1)) >= config.num_hidden_layers) or key.endswith(
        "rotary_emb.inv_freq"
    )


def open_safetensors(file: Path):
    """safe_open(file) (reads the header only); ValueError naming the file when it is not a complete
    safetensors file (a truncated download is refused here: the header no longer covers the data)."""
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise unreadable(file, exc) from None


def _iter_tensors(config: ModelConfig, files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if not skipped(config, name):
                    try:
                        t = f.get_tensor(name)
                    except (SafetensorError, OSError) as exc:
                        raise unreadable(file, exc) from None
                    yield name, t


def _expert_part(name: str) -> tuple[str, int, str] | None:
    """A per-expert checkpoint name -> (our stacked name, expert, "gate" | "up" | "down"), else None."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, e, kind = m.groups()
    stacked = "gate_up_proj" if kind in ("gate", "up") else "down_proj"
    return f"{prefix}.{stacked}", int(e), kind


class _StackedExperts:
    """Collects per-expert tensors into our stacked experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I],
    allocated on first use; `missing()` names the parts never given."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device) -> None:
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled: dict[str, set[tuple[int, str]]] = {}

    def put(self, key: str, e: int, kind: str, t: torch.Tensor, name: str) -> None:
        shape = self.shapes.get(key)
        if shape is None or not 0 <= e < shape[0]:
            raise ValueError(f"checkpoint: unexpected tensor {name!r}")
        half = shape[1] // 2 if kind != "down" else shape[1]
        want = (half, shape[2])
        if tuple(t.shape) != want:
            raise ValueError(f"checkpoint: tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
        if key not in self.tensors:
            self.tensors[key] = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.filled[key] = set()
        rows = slice(half, 2 * half) if kind == "up" else slice(0, half)
        self.tensors[key][e, rows] = t.to(device=self.device, dtype=self.dtype)
        self.filled[key].add((e, kind))

    def missing(self) -> list[str]:
        out = []
        for key, done in self.filled.items():
            kinds = ("down",) if key.endswith("down_proj") else ("gate", "up")
            out += [
                f"{key}[{e}].{k}" for e in range(self.shapes[key][0]) for k in kinds if (e, k) not in done
            ]
        return out


FP8 = (torch.float8_e4m3fn,)
SCALE = "_scale_inv"


def dequantize_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str
) -> torch.Tensor:
    """Block FP8: w [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 w * scale."""
    out, inn = w.shape
    bo, bi = block
    if scale_inv.shape != (-(-out // bo), -(-inn // bi)):
        raise ValueError(
            f"checkpoint: {name}{SCALE} has shape {tuple(scale_inv.shape)}, expected "
            f"{(-(-out // bo), -(-inn // bi))} for a {tuple(w.shape)} weight in {bo}x{bi} blocks"
        )
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn]
    return w.float() * scale


def _dequantized(config: ModelConfig, named: Iterator[tuple[str, torch.Tensor]]):
    """Pairs every float8 `X.weight` with its `X.weight_scale_inv` (any order, any shard) and yields
    the dequantized float32 weight; other tensors pass through."""
    block = config.fp8_block_size
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in named:
        is_scale = name.endswith(SCALE)
        if not is_scale and t.dtype not in FP8:
            yield name, t
            continue
        if block is None:
            raise ValueError(f"checkpoint: {name} is block-FP8 but config.json has no quantization_config")
        key = name.removesuffix(SCALE)
        (scales if is_scale else weights)[key] = t
        if key in weights and key in scales:
            yield key, dequantize_fp8(weights.pop(key), scales.pop(key), block, key)
    unpaired = sorted(set(weights) | set(scales))
    if unpaired:
        raise ValueError(f"checkpoint: FP8 weights and {SCALE} not paired for {unpaired[:8]}")


def canonical_tensors(
    config: ModelConfig, named: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF checkpoint names -> our parameter names ("model." dropped; per-expert tensors keep their names
    and are stacked by state_dict_from_hf, transformers' stacked experts pass through); tensors of
    layers >= num_hidden_layers (the MTP layer) and rotary buffers are skipped; block-FP8 weights are
    dequantized with their weight_scale_inv."""
    kept = ((n, t) for n, t in named if not skipped(config, n))
    for name, t in _dequantized(config, kept):
        yield name.removeprefix("model."), t


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The router stays float32, as transformers' _keep_in_fp32_modules_strict."""
    return torch.float32 if name.endswith(("mlp.gate.weight", "e_score_correction_bias")) else dtype


def state_dict_from_hf(
    model: DeepseekV3ForCausalLM,
    named: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Checked, converted state dict; ValueError naming missing / extra tensors or a shape mismatch."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stacked = _StackedExperts(expected, dtype, device)
    state: dict[str, torch.Tensor] = {}
    extra = []
    for key, t in canonical_tensors(model.config, named):
        part = _expert_part(key)
        if part is not None:
            stacked.put(*part, t, key)
        elif key not in expected:
            extra.append(key)
        elif tuple(t.shape) != expected[key]:
            raise ValueError(
                f"checkpoint: tensor {key!r} has shape {tuple(t.shape)}, expected {expected[key]}"
            )
        else:
            state[key] = t.to(device=device, dtype=_target_dtype(key, dtype))
    if extra:
        raise ValueError(f"checkpoint: unexpected tensors {sorted(extra)[:8]} ({len(extra)} in all)")
    partial = stacked.missing()
    if partial:
        raise ValueError(f"checkpoint: missing tensors {partial[:8]} ({len(partial)} in all)")
    state.update(stacked.tensors)
    if model.config.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint: missing tensors {missing[:8]} ({len(missing)} in all)")
    return state


def model_from_hf_tensors(
    config: ModelConfig,
    named: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DeepseekV3ForCausalLM:
    """Build the model from (HF name, tensor) pairs without a random init (meta device + assign)."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.load_state_dict(state_dict_from_hf(model, named, dtype, device), strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DeepseekV3ForCausalLM:
    """Load a HF checkpoint dir: config.json and model.safetensors or a sharded model.safetensors.index.json.

    Raises FileNotFoundError for a missing directory or file, ValueError naming the file for broken JSON
    or an unreadable safetensors file, and ValueError for an unsupported config value, a missing or
    unexpected tensor, or a shape mismatch. Weights are cast to `dtype` (router kept float32); block-FP8
    checkpoints (DeepSeek-V3 / Kimi-K2 as published: e4m3 + weight_scale_inv) are dequantized.
    """
    path = checkpoint_dir(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path: no config.json in {path}")
    config = ModelConfig.from_json(path / "config.json")
    files = checkpoint_files(path)
    for file in files:  # every header first: a broken shard fails before any weight is read
        with open_safetensors(file):
            pass
    return model_from_hf_tensors(config, _iter_tensors(config, files), dtype, device)
