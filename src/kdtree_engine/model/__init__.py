"""DeepSeek-V3 / Kimi-K2 target model: config, latent KV cache, forward, loader, greedy generation."""

from kdtree_engine.model.cache import LatentKVCache
from kdtree_engine.model.config import ModelConfig
from kdtree_engine.model.greedy import greedy_generate
from kdtree_engine.model.loader import load_model
from kdtree_engine.model.model import DeepseekV3ForCausalLM, ForwardOutput
from kdtree_engine.model.testing import random_model, tiny_config

__all__ = [
    "DeepseekV3ForCausalLM",
    "ForwardOutput",
    "LatentKVCache",
    "ModelConfig",
    "greedy_generate",
    "load_model",
    "random_model",
    "tiny_config",
]
