"""The auto budget call by call: for a `bench e2e --auto` result, each (batch, temperature) setting's
calls (prompt groups; every row runs the same groups) with auto's time against every other row's on the
same group, the fastest row of that group, and why auto's rounds got their buckets (the round log's
reasons, engine.budget.PICK_REASONS, counted per bucket). Where auto loses to the best row of the
setting, this tells whether it lost on a few calls (a choice that went wrong there) or evenly.

    python scripts/auto_calls.py out/e2e/e2e_nano.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def row_name(row: dict) -> str:
    """A row's short name: ar, dflash or the DDTree budget (auto included)."""
    if row["method"] == "autoregressive":
        return "ar"
    return "dflash" if row["method"] == "dflash" else str(row["budget"])


def reasons(log: list[list] | None) -> str:
    """The rounds of one call's log counted per bucket and reason ("16 rule 30, 0 call 8")."""
    counts = Counter((entry[0], entry[2]) for entry in log or [])
    return ", ".join(f"{k} {why} {n}" for (k, why), n in sorted(counts.items()))


def setting_lines(rows: list[dict]) -> list[str]:
    """The lines of one setting: its auto row against the best row, then each call."""
    auto = next(r for r in rows if r["budget"] == "auto")
    others = [r for r in rows if r["budget"] != "auto"]
    best = max(others, key=lambda r: r["tokens_per_s"])
    ratio = auto["tokens_per_s"] / best["tokens_per_s"]
    lines = [
        f"batch {auto['batch']}, temperature {auto['temperature']}: auto {auto['tokens_per_s']:.0f} "
        f"tokens/s, best {row_name(best)} {best['tokens_per_s']:.0f} ({ratio:.3f})"
    ]
    logs = auto.get("round_log") or [None] * len(auto["call_log"])
    for i, (call, log) in enumerate(zip(auto["call_log"], logs, strict=True)):
        times = {row_name(r): r["call_log"][i][1] for r in others}
        fastest = min(times, key=times.get)
        same = [row_name(r) for r in others if _text(r, i) is not None and _text(r, i) == _text(auto, i)]
        lines.append(
            f"  call {i}: auto {call[1]:.2f} ms in {call[2]} rounds; {row_name(best)} "
            f"{times[row_name(best)]:.2f}, fastest {fastest} {times[fastest]:.2f}, ar {times['ar']:.2f}; "
            f"{reasons(log)}; auto's text also {' '.join(same) or 'none'}"
        )
    return lines + same_text_line(auto, best)


def _text(row: dict, call: int) -> str | None:
    """The digest of a row's call's text (bench e2e's call_log), None in a result without it."""
    entry = row["call_log"][call]
    return entry[3] if len(entry) > 3 else None


def same_text_line(auto: dict, best: dict) -> list[str]:
    """Auto against the best row on the calls where both decoded the same text (none in a result without
    texts' digests): what remains of the gap when neither row's texts are luckier."""
    calls = [
        i
        for i in range(len(auto["call_log"]))
        if _text(auto, i) is not None and _text(auto, i) == _text(best, i)
    ]
    if not calls:
        return []
    ms = [sum(row["call_log"][i][1] for i in calls) for row in (auto, best)]
    name, total = row_name(best), len(auto["call_log"])
    return [f"  same text as {name} in {len(calls)} of {total} calls: auto {ms[0]:.2f} ms, {name} "
            f"{ms[1]:.2f} ms ({ms[1] / ms[0]:.3f})"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a bench e2e --auto result (e2e_nano.json or e2e.json)")
    rows = json.loads(parser.parse_args().result.read_text())["rows"]
    settings = sorted({(r["batch"], r["temperature"]) for r in rows if r["budget"] == "auto"})
    for setting in settings:
        print("\n".join(setting_lines([r for r in rows if (r["batch"], r["temperature"]) == setting])))


if __name__ == "__main__":
    main()
