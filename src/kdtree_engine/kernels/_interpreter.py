"""Fixes for the Triton interpreter (TRITON_INTERPRET=1, how CI runs the kernels on the CPU), applied on
import by every kernel module that needs them; compiled kernels are untouched."""

from __future__ import annotations

import os

import triton.language as tl


def _patch_interpreter() -> None:
    """Two Triton 3.6 interpreter bugs (CPU only; compiled kernels are untouched): scalars are
    1-element arrays whose `__index__` calls int(), which numpy >= 2.3 refuses, so `range()` over a
    loaded bound fails; and `tl.dot` multiplies bf16 operands as their raw uint16 bit patterns.
    Index the element, and widen bf16 operands to float32 (exact) before the product."""
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

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter._kdtree_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()
