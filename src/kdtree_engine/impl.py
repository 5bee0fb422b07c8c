"""The one vocabulary for choosing an implementation, shared by every op, the model and the engine.

- "ref": the plain torch reference (the specification; any device).
- "triton": the Triton kernels (CUDA GPUs; the CPU through the Triton interpreter, as in CI).
- "hopper": the Hopper (sm_90) kernels where an op has one (the tree-verify attention), else the op's
  Triton kernel (the tree ops have no Hopper-specific kernel).
- None: the fastest that applies: "hopper" where it applies, else "triton" on CUDA, else "ref".
"""

from __future__ import annotations

import os

import torch

IMPLS = ("ref", "triton", "hopper")


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


def check_impl(impl: str | None) -> None:
    """ValueError naming `impl` unless it is None or one of IMPLS (kernels need triton installed)."""
    if impl is None:
        return
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl != "ref" and not triton_available():
        raise ValueError(f"impl: {impl!r} requested but triton is not installed (pip install triton)")


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """The implementation an op without a Hopper-specific kernel runs: "ref" or "triton". None picks
    "triton" for CUDA tensors (when triton imports) and "ref" otherwise; "hopper" runs "triton"."""
    check_impl(impl)
    if impl is None:
        return "triton" if device.type == "cuda" and triton_available() else "ref"
    return "ref" if impl == "ref" else "triton"


def kernels_unavailable(impl: str | None, device_type: str) -> bool:
    """Whether a kernel impl ("triton", "hopper") was asked for where it cannot run: off CUDA and not
    under the Triton interpreter (TRITON_INTERPRET=1, how the tests run kernels on the CPU)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return impl in ("triton", "hopper") and device_type != "cuda" and not interpreted
