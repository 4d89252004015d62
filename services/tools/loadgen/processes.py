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


def process_table() -> dict[int, tuple[str, list[str]]]:
    """Every process now, by pid: its command name and :func:`stat_fields`, from one pass over
    ``/proc`` (a sampler that needs several trees reads it once per sample, not per tree)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            name, rest = text.split("(", 1)[1].rsplit(")", 1)
            table[int(entry)] = (name, rest.split())
    return table


def process_tree(pid: int, table: dict[int, tuple[str, list[str]]] | None = None) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``, or a :func:`process_table` read
    before); empty once it is gone."""
    found = process_table() if table is None else table
    parents = {member: int(fields[1]) for member, (_, fields) in found.items()}
    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        if current in parents:
            tree.append(current)
            frontier += [child for child, parent in parents.items() if parent == current]
    return tree


def server_cpu_seconds(name: str, table: dict[int, tuple[str, list[str]]] | None = None) -> float:
    """CPU seconds of a multi-process server by command name (``postgres``): every process of
    that name alive now, and for its root (the one whose parent has another name) also the
    children it reaped (``cutime``, ``cstime``: backends and workers that ended)."""
    found = {
        pid: fields
        for pid, (command, fields) in (process_table() if table is None else table).items()
        if command == name
    }
    return sum(stat_seconds(s, reaped=int(s[1]) not in found) for s in found.values())


def stat_fields(path: str | Path) -> list[str] | None:
    """The fields after the command name of a ``stat`` file (``/proc/<pid>/stat`` or a
    thread's ``/proc/<pid>/task/<tid>/stat``: ``fields[1]`` is the parent id, ``[11:13]``
    user and system ticks, ``[13:15]`` those of the children it reaped); None once gone."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def stat_seconds(fields: list[str], reaped: bool = False) -> float:
    """User + system CPU seconds of :func:`stat_fields`; with ``reaped`` also those of the
    children the process waited for (workers that ended)."""
    used = int(fields[11]) + int(fields[12])
    if reaped:
        used += int(fields[13]) + int(fields[14])
    return used / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, every thread (threads that ended included);
    NaN once it is gone."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return float("nan") if fields is None else stat_seconds(fields)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of ``pid`` alive now, by thread id.

    Raises:
        FileNotFoundError: the process is gone.
    """
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = stat_fields(task / "stat")
        if fields is not None:
            found[int(task.name)] = stat_seconds(fields)
    return found


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
