"""Reading and writing bundles: tensors plus string metadata (op, seed, shapes, generator version)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

import kdtree_engine

GENERATOR_VERSION = "1"


@dataclass(frozen=True)
class Bundle:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]

    @property
    def params(self) -> dict:
        """The op's scalar arguments (budget, ...), stored as JSON in meta['params']."""
        return json.loads(self.meta.get("params", "{}"))


def write_bundle(
    path: str | Path, tensors: dict[str, torch.Tensor], *, op: str, seed: int, params: dict
) -> None:
    """Save tensors (made contiguous, on the CPU) with metadata describing how they were made."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {
        "op": op,
        "seed": str(seed),
        "params": json.dumps(params, sort_keys=True),
        "shapes": json.dumps({k: list(v.shape) for k, v in sorted(tensors.items())}),
        "generator_version": GENERATOR_VERSION,
        "package_version": kdtree_engine.__version__,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def read_bundle(path: str | Path) -> Bundle:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no golden bundle at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if meta.get("generator_version") != GENERATOR_VERSION:
        raise ValueError(
            f"path: bundle {path.name} was written by generator version {meta.get('generator_version')!r}, "
            f"this code reads {GENERATOR_VERSION!r}; regenerate with `kdtree-engine golden --regen`"
        )
    return Bundle(tensors=load_file(str(path)), meta=meta)
