"""Programmatic dependent launch (PDL): a launch that starts while its predecessor in the stream is still
finishing, so that a forward's chain of short dependent kernels does not pay each launch's start-up
(block scheduling, prologue) after the previous kernel's last block has left.

How it stays exact. A kernel launched with PDL (`launch(device)` gives the launch arguments) runs
`wait_then_release` as its very first statement: `griddepcontrol.wait` blocks until the previous kernel
in the stream has completed and its memory writes are visible, and only then `launch_dependents` lets the
next PDL kernel start its blocks. No PDL kernel touches memory before its wait, so every read-after-write
and write-after-read between launches keeps the order of a plain stream; what overlaps is the dependent's
launch and block start-up with the primary's tail. A kernel launched without PDL (cuBLAS, torch's own)
waits for its predecessor as usual. Captured CUDA graphs keep the programmatic edges.

PDL needs compute capability 9.0 or more and a Triton with grid dependency control (3.3 or later); under
the Triton interpreter, on the CPU, on older GPUs or Tritons, or with KDTREE_ENGINE_PDL=0 in the
environment the launches are plain (and the wait compiled out). The Gluon kernel's twin of
wait_then_release lives with it (mla_attention_hopper.py).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: no PDL (the kernels' PDL branch is never compiled)
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=16)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (a CUDA GPU of compute capability >= 9.0, compiled kernels,
    KDTREE_ENGINE_PDL not "0")."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("KDTREE_ENGINE_PDL", "1") == "0" or gdc_wait is None:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch(device: torch.device) -> dict:
    """The extra launch arguments of a kernel that takes `PDL: tl.constexpr = False` and calls
    wait_then_release(PDL) first: {"PDL": True, "launch_pdl": True} where enabled, else none."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the previous kernel, then let the next one start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
