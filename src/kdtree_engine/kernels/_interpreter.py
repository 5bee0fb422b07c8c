"""Fixes for the Triton interpreter (TRITON_INTERPRET=1, how CI runs the kernels on the CPU), applied on
import by every kernel module that needs them; compiled kernels are untouched."""

from __future__ import annotations

import os

import triton.language as tl


def _patch_interpreter() -> None:
    """Three Triton 3.6 interpreter bugs and one difference from the GPU (CPU only; compiled kernels are
    untouched): scalars are 1-element arrays whose `__index__` calls int(), which numpy >= 2.3 refuses,
    so `range()` over a loaded bound fails; `tl.dot` multiplies bf16 operands as their raw uint16 bit
    patterns; float32 to bf16 casts truncate where the GPU rounds to nearest even; and `tl.dot` is one
    BLAS gemm of the tile, whose summation order for a row can depend on the row's place in the tile
    (OpenBLAS on AMD EPYC does), while a GPU's mma reduces every output element in the same order
    wherever its row sits. Index the element, widen bf16 operands to float32 (exact) before the
    product, round bf16 casts to nearest even, and multiply a float tile row by row (one batched
    matmul of 1-row matrices), so that a row's bits depend on that row and the other operand only, as
    the row-invariance tests (issue 32) require."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_kdtree_patched", False):
        return
    patch_tensor, create_dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def row_by_row(a, b, d):
        """a [..., M, K] @ b [..., K, N] + d, each row of a multiplied as a matrix of its own."""
        rows = np.matmul(a.data[..., :, None, :], b.data[..., None, :, :], dtype=d.data.dtype)
        return interpreter.TensorHandle(rows[..., 0, :] + d.data, d.dtype.scalar)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = widen(a), widen(b)
        floats = a.data.dtype.kind == "f" and b.data.dtype.kind == "f"
        if floats and min(a.dtype.primitive_bitwidth, b.dtype.primitive_bitwidth) > 8:  # fp8: the stock path
            return row_by_row(a, b, d)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # round to nearest even
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            bits[nan] = 0x7FC0
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.InterpreterBuilder.cast_impl = patched_cast
    interpreter._kdtree_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()
