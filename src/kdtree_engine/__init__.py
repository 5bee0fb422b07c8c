"""kdtree-engine: exact GPU kernels and a reference engine for DDTree speculative decoding on
DeepSeek-V3 / Kimi-K2 class models (MLA attention + mixture of experts)."""

__version__ = "0.1.0"
