"""The one vocabulary for choosing an implementation, shared by every op, the model and the engine.

- "ref": the plain torch reference (the specification; any device).
- "triton": the Triton kernels (CUDA GPUs; the CPU through the Triton interpreter, as in CI).
- "hopper": the Hopper (sm_90) kernels where an op has one (the tree-verify attention), else the op's
  Triton kernel (the tree ops have no Hopper-specific kernel).
- None: the fastest that applies: "hopper" where it applies, else "triton" on CUDA, else "ref".

"triton" or "hopper" with CPU tensors, outside the Triton interpreter, is a ValueError naming `impl`
(check_impl with the tensors' device; resolve_impl checks it), not a Triton driver error.
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


def check_impl(impl: str | None, device: torch.device | str | None = None) -> None:
    """ValueError naming `impl` unless it is None or one of IMPLS (kernels need triton installed). With
    `device` (where the op's tensors are): also when a kernel impl cannot run there (kernels_unavailable:
    "triton" and "hopper" need CUDA tensors unless the Triton interpreter is on)."""
    if impl is None:
        return
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl != "ref" and not triton_available():
        raise ValueError(f"impl: {impl!r} requested but triton is not installed (pip install triton)")
    if device is not None and kernels_unavailable(impl, torch.device(device).type):
        raise ValueError(
            f"impl: {impl!r} runs GPU kernels and needs CUDA tensors, got tensors on {torch.device(device)}; "
            "use impl='ref' or None off CUDA (or set TRITON_INTERPRET=1 before importing kdtree_engine to "
            "run the Triton kernels in the slow CPU interpreter)"
        )


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """The implementation an op without a Hopper-specific kernel runs: "ref" or "triton". None picks
    "triton" for CUDA tensors (when triton imports) and "ref" otherwise; "hopper" runs "triton". A kernel
    impl off CUDA (without the Triton interpreter) is a ValueError naming `impl` (check_impl)."""
    check_impl(impl, device)
    if impl is None:
        return "triton" if device.type == "cuda" and triton_available() else "ref"
    return "ref" if impl == "ref" else "triton"


def kernels_unavailable(impl: str | None, device_type: str) -> bool:
    """Whether a kernel impl ("triton", "hopper") was asked for where it cannot run: off CUDA and not
    under the Triton interpreter (TRITON_INTERPRET=1, how the tests run kernels on the CPU)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return impl in ("triton", "hopper") and device_type != "cuda" and not interpreted
