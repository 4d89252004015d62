"""Where a running process's CPU goes, by what does the work: ``perf record`` with DWARF call
stacks (user and kernel), each sample put in the first category any frame of its stack
matches. py-spy sees only Python frames; this answers "what remains besides HPKE and fsync"
for the ingest target (docs/benchmarks.md, "Ingest CPU per contribution, before and after").
"""

from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path

#: (category, substrings of a frame's symbol or library): the first that any frame of a
#: sample's stack matches takes the sample: cryptography first, then fsync and SQLite's file
#: I/O by their system call's own entry point (the user stack above a system call may stop at
#: libc, so the library that made it is not always known; in the shuffler only SQLite uses
#: ``pwrite64`` and ``pread64``), SQLite's code, then sockets. What matches none is counted by
#: its system call, else by its leaf library (the interpreter running uvicorn, asyncio and the
#: route; libc ...).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("HPKE opening (OpenSSL inside cryptography's module)", ("_rust.abi3.so",)),
    ("hashes and HMAC (Python's hashlib, the system's OpenSSL)", ("libcrypto", "_hashlib")),
    ("kernel: fdatasync and fsync", ("_sys_fsync", "_sys_fdatasync")),
    ("kernel: SQLite's file reads and writes", ("_sys_pwrite64", "_sys_pread64")),
    ("SQLite's own code", ("libsqlite3", "_sqlite3")),
    ("kernel: sockets and epoll (loopback TCP)", ("tcp_", "sock_", "_sys_epoll", "ep_poll")),
    ("HTTP parsing (httptools)", ("httptools",)),
)


class PerfRecord:
    """``perf record`` of every thread of ``pid`` (DWARF stacks) until :meth:`stop`."""

    def __init__(self, pid: int, out: Path, rate: int = 250) -> None:
        if shutil.which("perf") is None:
            raise RuntimeError("perf is not installed (Debian: linux-perf)")
        self.data = out.with_suffix(".perf.data")
        self.log = out.with_suffix(".perf.log")
        command = ["perf", "record", "-q", "-F", str(rate), "--call-graph", "dwarf,16384"]
        with self.log.open("w") as log:
            self._process = subprocess.Popen(
                [*command, "-p", str(pid), "-o", str(self.data)], stdout=log, stderr=log
            )

    def stop(self) -> None:
        """End the recording (SIGINT makes perf write its file).

        Raises:
            RuntimeError: perf failed (``perf_event_paranoid``, no such process): its log.
        """
        self._process.send_signal(2)
        if self._process.wait(timeout=120) not in (0, -2) or not self.data.exists():
            raise RuntimeError(f"perf record failed: {self.log.read_text().strip()}")


def _stacks(data: Path) -> list[list[str]]:
    """Each sample's frames, leaf first, as ``symbol (library)``."""
    script = ["perf", "script", "-i", str(data), "--no-inline", "-F", "ip,sym,dso"]
    text = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    return [
        [line.strip().split(" ", 1)[-1] for line in block.splitlines() if line.strip()]
        for block in text.split("\n\n")
        if block.strip()
    ]


def shares(data: Path) -> list[tuple[str, float, int]]:
    """``(category, share of samples, samples in all)``, largest first (:data:`CATEGORIES`,
    then by system call or leaf library: the interpreter running uvicorn, asyncio and the
    route, libc ...)."""
    counts: collections.Counter[str] = collections.Counter()
    stacks = _stacks(data)
    for frames in stacks:
        joined = "\n".join(frames)
        found = next((name for name, marks in CATEGORIES if any(m in joined for m in marks)), "")
        if not found:
            found = _other(frames)
        counts[found] += 1
    total = max(1, len(stacks))
    return [(name, count / total, len(stacks)) for name, count in counts.most_common()]


def _other(frames: list[str]) -> str:
    """A sample no category took: its system call, a page fault, or its leaf library."""
    calls = [f.split(" ", 1)[0] for f in frames if "_x64_sys_" in f]
    if calls:
        return f"kernel: {calls[-1].split('_x64_sys_', 1)[1]}"
    if any("exc_page_fault" in f for f in frames):
        return "kernel: page faults"
    library = frames[0].rsplit("(", 1)[-1].rstrip(")") if frames else "?"
    return f"other: {Path(library).name}"
