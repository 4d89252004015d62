"""Sampling profiles of a running service process with py-spy (``pip install py-spy``): a
flame graph to look at, and the functions where most samples fall, to read in
docs/benchmarks.md."""

from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path


class Profile:
    """``py-spy record`` attached to ``pid`` (with its subprocesses) until :meth:`stop`."""

    def __init__(self, pid: int, out: Path, rate: int = 50) -> None:
        if shutil.which("py-spy") is None:
            raise RuntimeError("py-spy is not installed: pip install py-spy")
        self.raw = out.with_suffix(".txt")
        self.svg = out.with_suffix(".svg")
        command = ["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--subprocesses"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self._raw = subprocess.Popen([*command, "--format", "raw", "-o", str(self.raw)], **quiet)
        self._svg = subprocess.Popen([*command, "-o", str(self.svg)], **quiet)

    def stop(self) -> None:
        """End both recordings (SIGINT makes py-spy write its output)."""
        for process in (self._raw, self._svg):
            process.send_signal(2)
        for process in (self._raw, self._svg):
            process.wait(timeout=120)


def _frame(text: str) -> str:
    """``function (file)`` without the line number, so a function's lines add up."""
    name, _, where = text.strip().partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


#: Leaf frames of a thread that waits (a pool worker or the event loop with nothing to do).
IDLE = ("Condition.wait", "_worker (concurrent", "Runner.run", "EpollSelector.select")


def top_frames(
    raw: Path, within: str = "", ours: tuple[str, ...] = (), count: int = 12
) -> list[tuple[str, float, float]]:
    """``(function (file), share of busy samples inside it, share in it alone)`` from py-spy's
    collapsed stacks (samples of waiting threads left out), for the stacks that pass through
    a frame containing ``within``; with ``ours`` (path prefixes) only the functions of those
    files, ranked by samples inside."""
    inside: collections.Counter[str] = collections.Counter()
    alone: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit() or within not in stack:
            continue
        n, frames = int(samples), [_frame(f) for f in stack.split(";")[1:] if f.strip()]
        if not frames or frames[-1].startswith(IDLE):
            continue
        total += n
        for frame in set(frames):
            inside[frame] += n
        if frames:
            alone[frames[-1]] += n
    if ours:
        kept = [f for f in inside if any(f"({prefix}" in f for prefix in ours)]
        ranked = sorted(kept, key=lambda f: inside[f], reverse=True)[:count]
    else:
        ranked = sorted(inside, key=lambda f: alone[f], reverse=True)[:count]
    return [(f, inside[f] / max(total, 1), alone[f] / max(total, 1)) for f in ranked]
