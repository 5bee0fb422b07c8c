"""Generation: autoregressive, DFlash and DDTree loops, their configuration, sampling, stats, and the
tokenizer of a checkpoint folder (load_tokenizer)."""

from kdtree_engine.engine.config import METHODS, GenerationConfig
from kdtree_engine.engine.loop import GenerationOutput, Runner, chain_tree, generate
from kdtree_engine.engine.sampling import SamplingParams, accept_tokens, root_tree, target_probs
from kdtree_engine.engine.stats import STAGES, GenerationStats
from kdtree_engine.engine.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "METHODS",
    "STAGES",
    "GenerationConfig",
    "GenerationOutput",
    "GenerationStats",
    "Runner",
    "SamplingParams",
    "Tokenizer",
    "accept_tokens",
    "chain_tree",
    "generate",
    "load_tokenizer",
    "root_tree",
    "target_probs",
]
