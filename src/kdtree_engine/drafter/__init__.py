"""DFlash block-diffusion drafter: architecture, config, loader."""

from kdtree_engine.drafter.config import DFlashConfig, build_target_layer_ids, tiny_drafter_config
from kdtree_engine.drafter.loader import load_drafter, random_drafter, save_drafter
from kdtree_engine.drafter.model import DFlashDrafter, DrafterCache

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DrafterCache",
    "build_target_layer_ids",
    "load_drafter",
    "random_drafter",
    "save_drafter",
    "tiny_drafter_config",
]
