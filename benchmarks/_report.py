"""Shared helpers for the benchmark scripts: machine description and docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import scipy

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"


def pin_one_core() -> None:
    """Run the benchmark on a single core, as the issues' targets are stated."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})


def machine(pinned: bool = True) -> str:
    """CPU model, cores and library versions."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores{' (pinned to 1)' if pinned else ''}, "
        f"Python {platform.python_version()}, "
        f"numpy {np.__version__}, scipy {scipy.__version__}"
    )


def write_section(heading: str, body: str) -> None:
    """Replace (or append) the section that starts with ``heading`` in docs/benchmarks.md."""
    existing = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    if heading in existing:
        head, _, tail = existing.partition(heading)
        rest = tail.split("\n## ", 1)
        after = ("\n## " + rest[1]) if len(rest) > 1 else ""
        existing = head.rstrip() + "\n\n" + section + after
    else:
        existing = existing.rstrip() + "\n\n" + section
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(existing.rstrip() + "\n")
