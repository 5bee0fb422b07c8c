"""Choosing between the reference (`impl="ref"`) and the GPU kernels (`impl="triton"`)."""

from __future__ import annotations

import torch

IMPLS = ("ref", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on device's current stream: data checks that read a
    tensor (a host sync) must be skipped then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """None picks "triton" for CUDA tensors (when triton imports) and "ref" otherwise."""
    if impl is None:
        return "triton" if device.type == "cuda" and triton_available() else "ref"
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and not triton_available():
        raise ValueError("impl: 'triton' requested but triton is not installed (pip install triton)")
    return impl
