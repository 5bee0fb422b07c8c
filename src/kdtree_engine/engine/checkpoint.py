"""A target checkpoint and a DFlash drafter checkpoint as folders, read in two steps: `read_checkpoints`
checks the paths and reads the small files (config.json, generation_config.json), so that every size
and every argument can be checked before anything large is read; `load_checkpoints` then loads the
weights. Shared by `kdtree-engine generate` and the benchmarks.

Errors name the argument they are about (the `argument` of `checkpoint_dir`, e.g. `--model`): a
FileNotFoundError for a missing folder or file, a ValueError naming the file for broken JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kdtree_engine.engine.checks import is_int

TARGET_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
GENERATION_CONFIG = "generation_config.json"


def checkpoint_dir(path: str | Path, argument: str, drafter: bool = False) -> Path:
    """path as a Path, after checking it is a checkpoint folder: it exists, is a folder, holds a
    config.json and weights (a target: model.safetensors or its index; a drafter: any *.safetensors).
    FileNotFoundError naming `argument` (the flag or parameter that gave the path) otherwise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{argument}: {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"{argument}: {path} is not a directory (pass the checkpoint directory)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{argument}: no config.json in {path}")
    if drafter and not (path / TARGET_WEIGHTS[1]).is_file() and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{argument}: no *.safetensors file in {path}")
    if not drafter and not any((path / name).is_file() for name in TARGET_WEIGHTS):
        raise FileNotFoundError(f"{argument}: no {' or '.join(TARGET_WEIGHTS)} in {path}")
    return path


def _number(path: Path, d: dict, key: str, kind: str):
    """d[key] when it is a number (kind "an int": an int), None when absent; ValueError otherwise."""
    value = d.get(key)
    ok = (
        is_int(value) if kind == "an int" else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if value is not None and not ok:
        raise ValueError(f"{GENERATION_CONFIG}: {key} must be {kind}, got {value!r} ({path})")
    return value


def _token_ids(path: Path, value) -> tuple[int, ...]:
    ids = [value] if not isinstance(value, list) else value
    if not all(is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{GENERATION_CONFIG}: eos_token_id must be token ids, got {value!r} ({path})")
    return tuple(ids)


def generation_defaults(model_dir: str | Path) -> dict:
    """GenerationConfig values from model_dir/generation_config.json, by field name: temperature, top_p
    and top_k when its do_sample is true (transformers ignores them otherwise), max_new_tokens, and
    stop_tokens from eos_token_id. {} without the file; ValueError naming it when it is broken."""
    from kdtree_engine.model.config import read_json

    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    d = read_json(path)
    out = {}
    if d.get("do_sample") is True:
        temperature = _number(path, d, "temperature", "a number")
        out["temperature"] = 1.0 if temperature is None else temperature
        for key, kind in (("top_p", "a number"), ("top_k", "an int")):
            if _number(path, d, key, kind) is not None:
                out[key] = d[key]
    if _number(path, d, "max_new_tokens", "an int") is not None:
        out["max_new_tokens"] = d["max_new_tokens"]
    if d.get("eos_token_id") is not None:
        out["stop_tokens"] = _token_ids(path, d["eos_token_id"])
    return out


def eos_tokens(model_config) -> tuple[int, ...]:
    """The target config's eos_token_id as stop tokens (none when it has none)."""
    eos = model_config.eos_token_id
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


@dataclass(frozen=True)
class Checkpoints:
    """The checked folders and their small files: target_config (ModelConfig), drafter_config
    (DFlashConfig, None without a drafter) and defaults (GenerationConfig values from the target's
    generation_config.json, see generation_defaults)."""

    target_dir: Path
    target_config: object
    drafter_dir: Path | None
    drafter_config: object | None
    defaults: dict

    @property
    def block_size(self) -> int:
        """The drafter's block size (1 without a drafter: one token per round)."""
        return self.drafter_config.block_size if self.drafter_config is not None else 1


def _read_config(cls, path: Path, argument: str):
    """cls.from_json(path / "config.json"), a ValueError that does not name the file naming it and the
    argument (e.g. a target folder passed as the drafter)."""
    file = path / "config.json"
    try:
        return cls.from_json(file)
    except ValueError as exc:
        if str(file) in str(exc):
            raise
        raise ValueError(f"{argument}: {file}: {exc}") from None


def read_checkpoints(
    model_dir: str | Path,
    drafter_dir: str | Path | None = None,
    *,
    model_argument: str = "model_dir",
    drafter_argument: str = "drafter_dir",
) -> Checkpoints:
    """Checks both folders (checkpoint_dir; errors name model_argument / drafter_argument) and reads
    their config.json and the target's generation_config.json. No weight is read."""
    from kdtree_engine.drafter.config import DFlashConfig
    from kdtree_engine.model.config import ModelConfig

    target_dir = checkpoint_dir(model_dir, model_argument)
    drafter_path = (
        None if drafter_dir is None else checkpoint_dir(drafter_dir, drafter_argument, drafter=True)
    )
    target_config = _read_config(ModelConfig, target_dir, model_argument)
    drafter_config = (
        None if drafter_path is None else _read_config(DFlashConfig, drafter_path, drafter_argument)
    )
    return Checkpoints(
        target_dir, target_config, drafter_path, drafter_config, generation_defaults(target_dir)
    )


def load_checkpoints(
    checkpoints: Checkpoints,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> tuple[object, object | None]:
    """(target, drafter or None): the weights of read_checkpoints' folders, loaded by model.load_model
    and drafter.load_drafter in dtype on device. progress(message) hears of each folder before it is
    read."""
    from kdtree_engine.drafter import load_drafter
    from kdtree_engine.model import load_model

    say = progress or (lambda message: None)
    say(f"loading target from {checkpoints.target_dir} ...")
    target = load_model(checkpoints.target_dir, dtype=dtype, device=device)
    drafter = None
    if checkpoints.drafter_dir is not None:
        say(f"loading drafter from {checkpoints.drafter_dir} ...")
        drafter = load_drafter(checkpoints.drafter_dir, dtype=dtype, device=device)
    return target, drafter


__all__ = [
    "Checkpoints",
    "checkpoint_dir",
    "eos_tokens",
    "generation_defaults",
    "load_checkpoints",
    "read_checkpoints",
]
