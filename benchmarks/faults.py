"""Faults survived (issue 49): the scenarios of tests/faults/ run longer, under a verified
``esa loadtest`` each, as one table of docs/reliability.md.

Each scenario (tests/faults/scenarios.py) starts its own deployment of real processes (the
launcher's, as ``esa up``), runs ``esa loadtest --rate R --duration S`` against it with every
party's own tokens, causes its fault part way through and records the load test's own
verification (acknowledged = received + deleted + held; counted twice = 0), the refusals its
devices waited out by status, and the time the deployment took to recover. The fault lasts a
quarter of ``--seconds`` (at least 5 s), the stopped replica the issue's 60 s (at most
``--seconds``); the clocks (shuffler-1 90 s ahead, a tenth of the devices 10 min ahead and a
tenth 10 min behind, libfaketime) stay off for the whole run; the commit points are crashed
once each, after the load (``--fault commit-points``). The faults that apply to either
backend (the analyzer outage, the bad network between shufflers and analyzer) run once per
``--backend`` (both by default: with PostgreSQL every party has its own database on a private
cluster). ``--write`` records the table in
docs/reliability.md ("## Faults under load"); without it the table is only printed.

Run: ``.venv/bin/python benchmarks/faults.py --seconds 60 --rate 100 [--write]`` (as root for
the full-disk fault: it mounts a tmpfs; PostgreSQL's server binaries for the restart fault).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import ROOT, add_write, machine, run_main, write_section

from tests.faults import scenarios
from tests.faults.cluster import Cluster, binaries
from tests.faults.harness import LIBFAKETIME, Load, Row, table

PAGE = ROOT / "docs" / "reliability.md"
HEADING = "## Faults under load"
#: Faults 1, 3 and 5 at the analyzer's storage and between devices and a shuffler.
STORAGE_AND_DEVICE_FAULTS = ("analyzer-postgres", "analyzer-disk", "device-network")
FAULTS = (
    "analyzer", "network", "postgres", "disk", "replica", "clocks", "commit-points",
    *STORAGE_AND_DEVICE_FAULTS
)  # fmt: skip
#: The faults run on each ``--backend``; the others have the one backend their fault needs.
BOTH_BACKENDS = ("analyzer", "network")
BACKENDS = ("sqlite", "postgresql")
#: The issue's stop of a replica behind HAProxy (at most ``--seconds``).
STOP_SECONDS = 60.0


def _scenario(name: str, tmp: Path, rate: float, seconds: float, backend: str) -> Row | str:
    """One fault's row, or why it was skipped (``backend``: of a fault of
    :data:`BOTH_BACKENDS`)."""
    if name in BOTH_BACKENDS and backend == "postgresql":
        bin = binaries()
        if bin is None:
            return "no PostgreSQL server binaries under /usr/lib/postgresql"
        with scenarios.every_party_on_postgres(bin) as databases:
            return _either_backend(name, tmp, rate, seconds, databases)
    if name in BOTH_BACKENDS:
        return _either_backend(name, tmp, rate, seconds, None)
    if name in STORAGE_AND_DEVICE_FAULTS:
        return _storage_or_device(name, tmp, rate, seconds)
    fault = max(seconds / 4, 5.0)
    # the long-epoch scenarios send each device once: rate x seconds of them
    once = Load(devices=int(rate * seconds), rate=rate, seconds=seconds + 10)
    if name == "clocks":
        if not LIBFAKETIME.exists():
            return f"no libfaketime ({LIBFAKETIME}; Debian package faketime)"
        # histogram epochs of 3 s: every device sends once per epoch
        return scenarios.clocks(tmp, Load(devices=int(rate * 3), rate=rate, seconds=seconds))
    if name == "postgres":
        bin = binaries()
        if bin is None:
            return "no PostgreSQL server binaries under /usr/lib/postgresql"
        return scenarios.postgres_restart(tmp, once, fault, bin)
    if name == "commit-points":
        return _commit_points(tmp, once)
    if name == "replica":
        bin = binaries()
        if bin is None or shutil.which("haproxy") is None:
            return "needs PostgreSQL's server binaries and haproxy"
        return scenarios.stopped_replica(tmp, once, min(STOP_SECONDS, seconds), bin)
    if os.geteuid() != 0:
        return "not root: a tmpfs cannot be mounted"
    return scenarios.full_disk(tmp, once, full_seconds=fault)


def _either_backend(
    name: str, tmp: Path, rate: float, seconds: float, databases: dict[str, str] | None
) -> Row:
    """A fault of :data:`BOTH_BACKENDS` on SQLite (``databases`` None) or PostgreSQL."""
    fault = max(seconds / 4, 5.0)
    # histogram epochs of 3 s: every device sends once per epoch, so rate x 3 devices keep
    # the rate up
    short = Load(devices=int(rate * 3), rate=rate, seconds=seconds)
    if name == "analyzer":
        return scenarios.analyzer_outage(tmp, short, fault, databases)
    return scenarios.bad_network(tmp, short, fault / 2, databases)


def _storage_or_device(name: str, tmp: Path, rate: float, seconds: float) -> Row | str:
    """A fault of :data:`STORAGE_AND_DEVICE_FAULTS`, or why it was skipped. The analyzer's
    faults run on 3-second epochs (the devices never see them), the devices' on one long
    epoch (each device sends once and retries as long as it must)."""
    fault = max(seconds / 4, 5.0)
    if name == "device-network":
        once = Load(devices=int(rate * seconds), rate=rate, seconds=seconds + 10)
        return scenarios.bad_device_network(tmp, once, fault_seconds=fault / 2)
    short = Load(devices=int(rate * 3), rate=rate, seconds=seconds)
    if name == "analyzer-disk":
        if os.geteuid() != 0:
            return "not root: a tmpfs cannot be mounted"
        return scenarios.analyzer_full_disk(tmp, short, full_seconds=fault)
    bin = binaries()
    if bin is None:
        return "no PostgreSQL server binaries under /usr/lib/postgresql"
    return scenarios.analyzer_postgres_restart(tmp, short, fault, bin)


def _commit_points(tmp: Path, load: Load) -> Row:
    """Fault 7, with shuffler-2 on a private PostgreSQL cluster when the server binaries are
    there (SQLite only otherwise)."""
    bin = binaries()
    if bin is None:
        return scenarios.commit_points(tmp, load)
    cluster = Cluster.create(bin)
    try:
        cluster.start()
        return scenarios.commit_points(tmp, load, {"shuffler-2": cluster.database("shuffler_2")})
    finally:
        cluster.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="load per fault (s)")
    parser.add_argument("--rate", type=float, default=100.0, help="contributions/s offered")
    parser.add_argument("--fault", choices=FAULTS, action="append", help="only these")
    parser.add_argument(
        "--backend", choices=BACKENDS, action="append",
        help="of the faults either backend serves (default: both)",
    )  # fmt: skip
    add_write(parser, also=" (here: docs/reliability.md)")
    args = parser.parse_args()
    rows: list[Row] = []
    skipped: list[str] = []
    for name, backend in _runs(args.fault or FAULTS, args.backend or BACKENDS):
        with tempfile.TemporaryDirectory(prefix=f"esa-fault-{name}-") as tmp:
            started = time.monotonic()
            found = _scenario(name, Path(tmp), args.rate, args.seconds, backend)
        if isinstance(found, str):
            skipped.append(f"{name} ({backend}): {found}")
            print(f"{name} ({backend}): skipped ({found})", file=sys.stderr)
            continue
        rows.append(found)
        took = time.monotonic() - started
        print(f"{name} ({found.backend}): done in {took:.0f} s", file=sys.stderr)
    body = _body(rows, skipped, args)
    print(body)
    write_section(HEADING, body, args.write, PAGE)


def _runs(faults: Sequence[str], backends: Sequence[str]) -> list[tuple[str, str]]:
    """(fault, backend) in order: a fault of :data:`BOTH_BACKENDS` once per backend, any
    other once (its backend is its own)."""
    return [
        (name, backend)
        for name in faults
        for backend in (backends if name in BOTH_BACKENDS else ["own"])
    ]


def _body(rows: list[Row], skipped: list[str], args: argparse.Namespace) -> str:
    """The section: the table, what was skipped, the command and the machine."""
    faults = " ".join(
        [f"--fault {name}" for name in args.fault or []]
        + [f"--backend {name}" for name in args.backend or []]
    )
    command = (
        f".venv/bin/python benchmarks/faults.py --seconds {args.seconds:g} "
        f"--rate {args.rate:g} {faults}".rstrip()
        + " --write"
    )
    skips = "".join(f"\n\nSkipped: {line}." for line in skipped)
    return (
        f"{table(rows)}{skips}\n\n"
        f"`{command}`, {time.strftime('%Y-%m-%d', time.gmtime())}. Machine: "
        f"{machine(pinned=False)} (services, load generator and faults share the cores)."
    )


if __name__ == "__main__":
    run_main(main)
