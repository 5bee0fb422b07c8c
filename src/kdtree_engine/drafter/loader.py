"""Loading and saving DFlash drafters in the published format (config.json + safetensors, optionally
sharded with model.safetensors.index.json), and seeded random drafters for tests and demos."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kdtree_engine.drafter.config import DFlashConfig
from kdtree_engine.drafter.model import DFlashDrafter
from kdtree_engine.model.loader import checkpoint_dir, index_shards, unreadable

INDEX = "model.safetensors.index.json"


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.is_file():
        files = [path / n for n in index_shards(index)]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"path: shard {f.name} named in {INDEX} is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path: no *.safetensors file in {path}")
    return files


def _read(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise unreadable(file, exc) from None


def _strip_prefix(name: str) -> str:
    # Some exports wrap the drafter in a `model.` namespace; the module itself has none.
    return name[len("model.") :] if name.startswith("model.") else name


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDrafter:
    """path: a checkpoint directory with config.json and safetensors. Every tensor of the drafter must
    be present and no other tensor (embed_tokens / lm_head copies, if shipped, are ignored).

    FileNotFoundError for a missing directory, config.json or weight file; ValueError naming the file
    for broken JSON or an unreadable safetensors file, and for a config or tensors that do not fit."""
    path = checkpoint_dir(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path: no config.json in {path}")
    config = DFlashConfig.from_json(path / "config.json")
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        for name, t in _read(f).items():
            state[_strip_prefix(name)] = t
    for shared in ("embed_tokens.weight", "lm_head.weight"):
        state.pop(shared, None)
    expected = dict(drafter.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"path: checkpoint tensors do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"path: tensor {name} has shape {tuple(t.shape)}, "
                f"config implies {tuple(expected[name].shape)}"
            )
    drafter = drafter.to_empty(device=device)
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return drafter.to(dtype).eval()


def save_drafter(drafter: DFlashDrafter, path: str | Path) -> None:
    """Writes config.json and model.safetensors in the published layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.config.to_hf_dict(), indent=2))
    # copies: the kernel path packs parameters as views of shared buffers (drafter/packed.py), which
    # safetensors refuses to write as they are
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))


def random_drafter(
    config: DFlashConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"
) -> DFlashDrafter:
    """A seeded random drafter (the global RNG is left untouched). Norm weights are randomized too,
    so that a loader mixing up tensor names cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                bound = p.shape[-1] ** -0.5
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return drafter.to(device=device, dtype=dtype).eval()
