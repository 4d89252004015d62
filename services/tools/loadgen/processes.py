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


#: pid -> (command name, :func:`stat_fields`): every process at one moment.
ProcessTable = dict[int, tuple[str, list[str]]]


def process_table() -> ProcessTable:
    """Every process now, by pid: its command name and :func:`stat_fields`, from one pass over
    ``/proc`` (a sampler that needs several trees reads it once per sample, not per tree). A
    process that ends during the pass is left out; a name that is not UTF-8 (the kernel cuts
    names at 15 bytes, maybe inside a character) is read with replacement characters."""
    table: ProcessTable = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_bytes().decode(errors="replace")
            except OSError:
                continue
            name, rest = text.split("(", 1)[1].rsplit(")", 1)
            table[int(entry)] = (name, rest.split())
    return table


def process_tree(pid: int, table: ProcessTable | None = None) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``, or a :func:`process_table` read
    before); empty once it is gone."""
    found = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for member, (_, fields) in found.items():
        children.setdefault(int(fields[1]), []).append(member)
    tree, frontier = [], [pid] if pid in found else []
    while frontier:
        current = frontier.pop()
        tree.append(current)
        frontier += children.get(current, [])
    return tree


def server_cpu_seconds(name: str, table: ProcessTable | None = None) -> float:
    """CPU seconds of the processes named ``name`` (``postgres``) on this machine, in
    containers too: each one's own, and for each whose parent has another name (a server's
    root) also the children it reaped (``cutime``, ``cstime``: backends and workers that
    ended). A child that ends and is reaped during :func:`process_table`'s pass can be
    missing from that one reading."""
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
        return Path(path).read_bytes().decode(errors="replace").rsplit(")", 1)[1].split()
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
            status = Path(f"/proc/{member}/status").read_bytes().decode(errors="replace")
            rss += 1024 * int(status.split("VmRSS:", 1)[1].split()[0])
            fds += len(os.listdir(f"/proc/{member}/fd"))
        except (OSError, IndexError):
            continue
    return Usage(rss, fds, len(tree))
