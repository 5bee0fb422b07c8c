"""Every Triton kernel of the shapes that matter, compiled for an H200 (sm_90) exactly as the package
launches it, on any machine with Triton's bundled ptxas (no GPU): the table behind docs/notes/kernels.md.
Per scenario and kernel variant: the launch's block sizes, warps and stages; registers per thread,
shared memory and spilled bytes; the depth of each asynchronous copy buffer and the first async wait
(0: no copy in flight while a tile is used); 16-bit global loads (bf16 read an element at a time).

    python scripts/compile_audit.py [--scenario SUBSTRING]

The scenarios and the harness are tests/kernels/launch_compile.py's (run from the repository root).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels.launch_compile import SCENARIOS, run_launch_script  # noqa: E402

SHOWN = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
HEADER = ("scenario", "kernel", "launch", "regs", "shared B", "spilled B", "copy buffers", "first wait",
          "16-bit loads")  # fmt: skip


def markdown_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def rows(found: dict, scenario_filter: str) -> list[str]:
    """Markdown rows, one per compiled kernel variant."""
    out = []
    for scenario, kernels in found.items():
        if scenario_filter not in scenario:
            continue
        for name, reports in kernels.items():
            for r in reports:
                launch = " ".join(f"{k}={r['constants'][k]}" for k in SHOWN if k in r["constants"])
                first_wait = r["waits"][0] if r["waits"] else "-"
                buffers = ",".join(map(str, r["copy_buffers"])) or "-"
                cells = (scenario, name, launch, r["regs"], r["shared"], r["local"], buffers, first_wait,
                         r["loads_16bit"])  # fmt: skip
                out.append(markdown_row(cells))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="", help="only scenarios whose name contains this")
    args = parser.parse_args()
    found = run_launch_script(SCENARIOS)
    print(markdown_row(HEADER))
    print(markdown_row(["---"] * len(HEADER)).replace(" ", ""))
    print("\n".join(rows(found, args.scenario)))


if __name__ == "__main__":
    main()
