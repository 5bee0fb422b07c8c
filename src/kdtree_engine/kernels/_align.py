"""Row alignment the compiler can see, for strides that a kernel keeps out of Triton's specialization.

Triton marks an int argument that is a multiple of 16 as such at launch, and the vector width of every
load follows from those marks. An argument in `do_not_specialize` (kept out so that one compiled kernel
serves every value, e.g. a batch stride that grows with the batch) is assumed to be any integer, so a
row that starts at `b * stride` may start anywhere: bf16 rows are then read two bytes at a time and the
loads cannot be turned into asynchronous copies (a software pipeline needs 4 bytes or more). The launch
checks instead what it knows (`stride_align`) and passes it as a constexpr, and the kernel rewrites
the stride through `aligned`, which changes no value and lets the compiler prove the alignment.
"""

from __future__ import annotations

import triton
import triton.language as tl

VECTOR_BYTES = 16  # the widest global load (ld.global.v4.b32)


def stride_align(itemsize: int, *strides: int) -> int:
    """The largest power of two n <= VECTOR_BYTES / itemsize that divides every stride (in elements)."""
    n = max(1, VECTOR_BYTES // itemsize)
    while n > 1 and any(s % n for s in strides):
        n //= 2
    return n


@triton.jit
def aligned(stride, ALIGN: tl.constexpr):
    """stride, a multiple of ALIGN (stride_align checked it), written so the compiler sees that it is."""
    return stride // ALIGN * ALIGN
