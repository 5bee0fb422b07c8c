"""Small plotting and table helpers shared by the benchmarks (matplotlib is optional: without it no PNG
is written and the caller is told so)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path


def utc_stamp() -> str:
    """Now, as every report header states when it was measured: "YYYY-MM-DD HH:MM UTC"."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def plot_series(
    path: str | Path,
    title: str,
    x_labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    *,
    ylabel: str = "microseconds (median)",
    logy: bool = True,
) -> bool:
    """One line per series over the categorical x axis; None values are skipped. Returns False when
    matplotlib is missing (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(x_labels) + 2), 4.5))
    xs = list(range(len(x_labels)))
    for name, values in series.items():
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xticks(xs, list(x_labels), rotation=45, ha="right", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats get 1 decimal below 1000 and none above, None prints as '-'."""

    def cell(v: object) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
