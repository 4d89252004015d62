"""How fast ``esa --help`` and ``esa --version`` answer, and how much memory they take.

Run: ``.venv/bin/python benchmarks/cli_startup.py [--write]``. Each command runs 7 times as a fresh
process (``python -m services.cli``, what the ``esa`` script runs); the table gives the median
wall time and the median peak RSS of the child. ``esa account --help`` is shown beside them: it
loads its command's stack (dp_accounting, scipy), which the others must not. ``--write``
records the "CLI start-up" section of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import ROOT, command_line, machine, write_section

SECTION = "## CLI start-up"
RUNS = 7
COMMANDS: tuple[list[str], ...] = (["--help"], ["--version"], [], ["account", "--help"])


def _one(arguments: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one ``esa`` process."""
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *arguments],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "100"},
    )
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"esa {' '.join(arguments)} failed")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    args = command_line(__doc__).parse_args()
    rows = []
    for arguments in COMMANDS:
        runs = [_one(arguments) for _ in range(RUNS)]
        wall = statistics.median(w for w, _ in runs)
        rss = statistics.median(r for _, r in runs)
        rows.append(f"| `esa {' '.join(arguments)}` | {wall:.3f} | {rss:.1f} |")
        print(rows[-1])
    body = "\n".join(
        [
            f"Machine: {machine(pinned=False)}. Command: `.venv/bin/python "
            f"benchmarks/cli_startup.py` (median of {RUNS} fresh processes each).",
            "",
            "Target: `esa --help` and `esa --version` under 0.5 s wall and 60 MiB. Commands load "
            "lazily (services/cli/__init__.py); tests/services/test_cli_entry.py guards which "
            "modules each of them loads.",
            "",
            "| command | wall (s) | peak RSS (MiB) |",
            "| --- | ---: | ---: |",
            *rows,
        ]
    )
    write_section(SECTION, body, args.write)


if __name__ == "__main__":
    main()
