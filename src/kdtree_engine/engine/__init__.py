"""Generation: autoregressive, DFlash and DDTree loops, sampling, stats."""

from kdtree_engine.engine.loop import METHODS, GenerationOutput, chain_tree, generate
from kdtree_engine.engine.sampling import SamplingParams, accept_tokens, root_tree, target_probs
from kdtree_engine.engine.stats import STAGES, GenerationStats

__all__ = [
    "METHODS",
    "STAGES",
    "GenerationOutput",
    "GenerationStats",
    "SamplingParams",
    "accept_tokens",
    "chain_tree",
    "generate",
    "root_tree",
    "target_probs",
]
