"""Group commit on SQLite: CPU per row of ``ContributionStore.insert`` by transaction size,
this tree against an earlier commit, in one run.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/sqlite_commit.py [--before REF]
[--rounds N]``. Each tree is measured in a process of its own (its own imports; the earlier
commit exported with ``git archive``), the trees alternating round by round. A round: a fresh
SQLite file set up as a shuffler sets up its own (WAL, ``synchronous=FULL``, the migrations),
:data:`PREFILL` rows stored first, then the same contributions committed in transactions of 1,
4, 16 and 51 rows (51: what a shuffler under ingest_cpu.py's load commits per ``fdatasync``),
the process's CPU (``time.process_time``, kernel time included: the log's writes and syncs)
per row. The floor: the same transactions on a bare ``sqlite3`` connection (``BEGIN
IMMEDIATE``, the revocation and close checks, the multi-row ``INSERT``, ``COMMIT``), measured
in this tree's process. Medians per tree (docs/benchmarks.md, "SQLite group commit: CPU
per transaction").
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The tree measured (its import path): this one unless ``ESA_TREE`` names an exported one.
ROOT = Path(os.environ.get("ESA_TREE") or Path(__file__).resolve().parents[1])
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

SIZES = (1, 4, 16, 51)
#: Rows stored before the timed transactions, and rows timed per transaction size.
PREFILL, TIMED = 10_000, 2_040
BEFORE = "9550cb5"


def measure(floor: bool) -> dict[str, float]:
    """CPU-µs per row at each transaction size (and the bare connection's, with ``floor``)."""
    from _store import migrated_sqlite  # the measured tree's
    from ingest_cpu import contributions

    from shuffler.records import Pending

    made = [Pending(secrets.token_hex(16), c, time.time()) for c in contributions(PREFILL + TIMED)]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "store.sqlite"
        engine, store = migrated_sqlite(path)
        for start in range(0, PREFILL, 1_000):
            store.insert(made[start : start + 1_000])
        timed = made[PREFILL:]
        found = {f"store {size}": _per_row(store.insert, timed, size) for size in SIZES}
        store.close()
        engine.dispose()
        if floor:
            found |= {f"bare {size}": _bare(path, timed, size) for size in SIZES}
    return found


def _per_row(insert: Callable[[list[Any]], Any], rows: Sequence[Any], size: int) -> float:
    """CPU-µs per row of ``insert`` called on consecutive slices of ``size`` rows, each row
    of ``rows`` once (a stored contribution is never stored again)."""
    chunk = len(rows) // len(SIZES)
    offset = SIZES.index(size) * chunk
    mine = rows[offset : offset + chunk]
    start = time.process_time()
    for at in range(0, len(mine), size):
        insert(list(mine[at : at + size]))
    return (time.process_time() - start) / len(mine) * 1e6


def _bare(path: Path, pending: Sequence[Any], size: int) -> float:
    """:func:`_per_row` for the same transactions on a bare ``sqlite3`` connection (fresh
    receipts and client ids: the rows are stored a second time)."""
    from shuffler import store as store_module
    from shuffler import store_backends, store_queries

    connection = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "wal_autocheckpoint=10000"):
        connection.execute(f"PRAGMA {pragma}")
    checks = store_backends._checks_sql("?", 1, 1)

    def insert(batch: list[Any]) -> None:
        receipts = store_module.new_receipts(len(batch))
        rows = [store_queries.contribution_row(p, r) for p, r in zip(batch, receipts, strict=True)]
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(checks, (rows[0][3], rows[0][0])).fetchall()
        values = tuple(value for row in rows for value in row)
        connection.execute(store_backends._insert_sql("?", len(rows)), values)
        connection.execute("COMMIT")

    try:
        fresh = [type(p)(secrets.token_hex(16), p.contribution, p.received_at) for p in pending]
        return _per_row(insert, fresh, size)
    finally:
        connection.close()


def _run_tree(tree: Path, floor: bool) -> dict[str, float]:
    """:func:`measure` in a process importing ``tree``."""
    env = {**os.environ, "ESA_TREE": str(tree), "PYTHONPATH": str(tree)}
    command = [sys.executable, __file__, "--measure", *(["--floor"] if floor else [])]
    done = subprocess.run(command, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    """Measure both trees round by round (or, with ``--measure``, this process's tree once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help=f"earlier commit (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.floor)))
        return
    from ingest_cpu import export

    with tempfile.TemporaryDirectory() as directory:
        trees = {"before": export(args.before, Path(directory) / "before"), "after": ROOT}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for index in range(args.rounds):
            for name, tree in trees.items():
                print(f"round {index + 1}/{args.rounds}: {name}", file=sys.stderr)
                rounds[name].append(_run_tree(tree, floor=name == "after"))
    print(f"before = {args.before}, after = this tree; CPU-µs per row, median of {args.rounds}")
    for name, measured in rounds.items():
        for key in measured[0]:
            median = statistics.median(r[key] for r in measured)
            print(
                f"{name:6} {key:9} {median:7.1f}  ({', '.join(f'{r[key]:.1f}' for r in measured)})"
            )


if __name__ == "__main__":
    main()
