"""CPU, memory and file descriptors of the services' process trees, read from ``/proc``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# --- the services' processes --------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Resident memory and open file descriptors of a process and its descendants."""

    rss_bytes: int
    fds: int
    processes: int


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``); empty once it is gone."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        if current in parents:
            tree.append(current)
            frontier += [child for child, parent in parents.items() if parent == current]
    return tree


def process_usage(pid: int) -> Usage:
    """:class:`Usage` of ``pid`` and every process below it (Linux ``/proc``); zeros once it
    is gone."""
    tree = process_tree(pid)
    rss = fds = 0
    for member in tree:
        try:
            status = Path(f"/proc/{member}/status").read_text()
            rss += 1024 * int(status.split("VmRSS:", 1)[1].split()[0])
            fds += len(os.listdir(f"/proc/{member}/fd"))
        except (OSError, IndexError):
            continue
    return Usage(rss, fds, len(tree))
