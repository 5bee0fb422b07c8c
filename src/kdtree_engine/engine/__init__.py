"""Generation: autoregressive, DFlash and DDTree loops, their configuration, sampling, stats."""

from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.loop import GenerationOutput, chain_tree, generate
from kdtree_engine.engine.sampling import SamplingParams, accept_tokens, root_tree, target_probs
from kdtree_engine.engine.stats import STAGES, GenerationStats

__all__ = [
    "METHODS",
    "STAGES",
    "GenerationConfig",
    "GenerationOutput",
    "GenerationStats",
    "SamplingParams",
    "accept_tokens",
    "chain_tree",
    "generate",
    "root_tree",
    "target_probs",
]
