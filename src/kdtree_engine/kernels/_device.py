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


def device_multiprocessors(device: torch.device) -> int:
    """multiprocessors() of a torch.device (the current CUDA device when it has no index)."""
    if device.type != "cuda":
        return multiprocessors(-1)
    return multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
