"""Device facts the kernels' launch heuristics read (cached per device)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def multiprocessors(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index`; 4 for the CPU (index -1: the Triton
    interpreter, where a few programs are enough)."""
    if device_index < 0:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count
