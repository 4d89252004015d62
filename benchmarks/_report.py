"""Shared helpers for the benchmark scripts: machine description and docs/benchmarks.md.

A benchmark changes docs/benchmarks.md only when run with ``--write`` (:func:`add_write`), the
one switch every script takes: without it the run prints its result and leaves the file as it
is, so trying a benchmark never rewrites the published numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
#: What ``--write`` does, in every benchmark's ``--help``.
WRITE_HELP = (
    "record this run: rewrite this benchmark's section of docs/benchmarks.md with its result "
    "(without --write the result is only printed and docs/benchmarks.md is left as it is)"
)


def add_write(parser: argparse.ArgumentParser, also: str = "") -> None:
    """Give ``parser`` the ``--write`` switch (``also``: what else it writes, for --help)."""
    parser.add_argument("--write", action="store_true", help=WRITE_HELP + also)


def command_line(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser for a benchmark that takes no other options: its docstring's first
    paragraph as the description, and ``--write``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    add_write(parser)
    return parser


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


def write_section(heading: str, body: str, write: bool, doc: Path | None = None) -> None:
    """With ``write`` (the script's ``--write``), replace (or append) the section that starts
    with ``heading`` in ``doc`` (:data:`DOC`, docs/benchmarks.md, unless told); without it,
    leave the file alone. Either way say which on stderr."""
    doc = DOC if doc is None else doc
    name = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    if not write:
        print(f"{name} left as it is (--write records {heading!r})", file=sys.stderr)
        return
    existing = doc.read_text() if doc.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    if heading in existing:
        head, _, tail = existing.partition(heading)
        rest = tail.split("\n## ", 1)
        after = ("\n## " + rest[1]) if len(rest) > 1 else ""
        existing = head.rstrip() + "\n\n" + section + after
    else:
        existing = existing.rstrip() + "\n\n" + section
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(existing.rstrip() + "\n")
    print(f"{name}: wrote {heading!r}", file=sys.stderr)


def run_main(main: Callable[[], object]) -> None:
    """Run a benchmark that starts services so that SIGTERM, SIGINT or SIGHUP (``timeout``, a
    cancelled job, Ctrl-C) end it as our commands end: every ``finally`` runs, stopping the
    deployment it started and removing its folders, instead of leaving them running."""
    from services.tools import stopping

    with stopping.stops_cleanly(f"benchmarks/{Path(sys.argv[0]).name}"):
        main()


def quiet_worker() -> None:
    """A benchmark's pool worker ends at its parent's word, silently: the stopping handlers
    :func:`run_main` installs are not inherited across the fork (SIGTERM ends the worker,
    Ctrl-C at the terminal is the parent's to act on)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
