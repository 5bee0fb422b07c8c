"""The learning-rate schedule both training commands use, and the optional matplotlib import of their
loss plots."""

from __future__ import annotations

import math


def warmup_cosine(lr: float, step: int, warmup_steps: int, progress: float, min_lr_ratio: float) -> float:
    """Linear warm-up over warmup_steps (step is 0-based), then cosine from lr down to lr * min_lr_ratio
    as progress (the fraction of the schedule after the warm-up) goes from 0 to 1 (clamped)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend, or None when matplotlib is not installed (the
    plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
