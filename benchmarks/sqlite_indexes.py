"""What SQLite's durable insert of a contribution costs, and how much two indexes keyed by
random values (the nonce's, for replay protection, and the quota's: client, channel, epoch)
would add: the shuffler checks both in memory on SQLite since migration 0007.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/sqlite_indexes.py [--prefill N]
[--rows N] [--variants NAME ...]``. Each variant is a fresh file on a bare ``sqlite3``
connection: the ``contributions`` table and indexes exactly as the shuffler's migrations make
them (read from a migrated file, then edited per variant), WAL, ``synchronous=FULL``, the
store's checkpoint interval; ``--prefill`` rows stored first, then ``--rows`` more in
transactions of 51 (the group commit's size under load) through the store's own multi-row
``INSERT``. Prints the CPU-µs per row spent in the statement and in ``COMMIT`` (the log's
writes and ``fdatasync``). For where the CPU goes, run it under ``perf record -g``
(docs/benchmarks.md, "Ingest CPU per contribution, before and after").
"""

from __future__ import annotations

import argparse
import os
import secrets
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _store import COMMIT_ROWS, migrated_sqlite

from common.envelope import inner_size, new_nonce
from shuffler.records import pack_fragments
from shuffler.store import new_receipts
from shuffler.store_backends import WAL_AUTOCHECKPOINT_PAGES, _insert_sql

#: name: (edit of the table's DDL, extra DDL, page size, checkpoint interval in pages)
VARIANTS: dict[str, tuple[dict[str, str], list[str], int, int]] = {
    "shipped (the replay and quota checks in memory)": ({}, [], 4096, WAL_AUTOCHECKPOINT_PAGES),
    "with the two random-keyed unique indexes (as before migration 0007)": (
        {},
        [
            "CREATE UNIQUE INDEX n ON contributions (nonce)",
            "CREATE UNIQUE INDEX q ON contributions (client_id, channel_id, epoch)",
        ],
        4096,
        WAL_AUTOCHECKPOINT_PAGES,
    ),
    "the two as plain (non-unique) indexes": (
        {},
        [
            "CREATE INDEX n ON contributions (nonce)",
            "CREATE INDEX q ON contributions (client_id, channel_id, epoch)",
        ],
        4096,
        WAL_AUTOCHECKPOINT_PAGES,
    ),
    "2 KiB pages": ({}, [], 2048, WAL_AUTOCHECKPOINT_PAGES),
    "checkpoint every 50,000 pages": ({}, [], 4096, 50_000),
}


def shipped_schema(directory: Path) -> list[str]:
    """The DDL of ``contributions`` and its indexes, from a file the migrations made."""
    engine, _ = migrated_sqlite(directory / "migrated.sqlite")
    engine.dispose()
    with sqlite3.connect(directory / "migrated.sqlite") as conn:
        found = conn.execute(
            "SELECT sql FROM sqlite_master WHERE tbl_name = 'contributions' AND sql IS NOT NULL "
            "ORDER BY type DESC"  # the table before its indexes
        )
        return [sql for (sql,) in found]


def schema(shipped: list[str], edits: dict[str, str], extra: list[str]) -> list[str]:
    """``shipped`` with ``edits`` made to the table's DDL (each must apply) and ``extra``."""
    table = shipped[0]
    for old, new in edits.items():
        if old not in table:
            raise ValueError(f"the shipped table no longer has {old.strip()!r}: {table}")
        table = table.replace(old, new)
    return [table, *shipped[1:], *extra]


def rows(count: int, epoch: int) -> list[tuple[object, ...]]:
    """``count`` rows as the store writes them: 8 fragments of the ``homepage`` size."""
    fragments = pack_fragments([os.urandom(inner_size(16)) for _ in range(8)])
    return [
        ("homepage", "", epoch, secrets.token_hex(16), new_nonce(), fragments, 8, time.time(), r)
        for r in new_receipts(count)
    ]


def measure(
    path: Path, ddl: list[str], page: int, checkpoint: int, args: argparse.Namespace
) -> tuple[float, float]:
    """CPU-µs per row in the statement and in ``COMMIT``, after ``--prefill`` rows."""
    conn = sqlite3.connect(path, isolation_level=None)
    pragmas = [f"page_size={page}", "journal_mode=WAL", "synchronous=FULL"]
    for pragma in [*pragmas, f"wal_autocheckpoint={checkpoint}"]:
        conn.execute(f"PRAGMA {pragma}")
    for sql in ddl:
        conn.execute(sql)
    epoch, insert = int(time.time() // 86_400), _insert_sql("?", COMMIT_ROWS)
    statement = commit = 0.0
    batches = -(-args.prefill // COMMIT_ROWS), -(-args.rows // COMMIT_ROWS)
    for batch in range(sum(batches)):
        values = [value for row in rows(COMMIT_ROWS, epoch) for value in row]
        start = time.process_time()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(insert, values)
        inserted = time.process_time()
        conn.execute("COMMIT")
        if batch >= batches[0]:
            statement += inserted - start
            commit += time.process_time() - inserted
    conn.close()
    measured = batches[1] * COMMIT_ROWS
    return statement / measured * 1e6, commit / measured * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=100_000, help="rows stored first")
    parser.add_argument("--rows", type=int, default=20_000, help="rows measured")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        metavar="NAME",
        help=f"which to run (default all: {'; '.join(VARIANTS)})",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        shipped = shipped_schema(Path(directory))
        print(f"{args.prefill:,} rows first, then {args.rows:,} in transactions of {COMMIT_ROWS}")
        for index, name in enumerate(args.variants):
            edits, extra, page, checkpoint = VARIANTS[name]
            path = Path(directory) / f"variant-{index}.sqlite"
            statement, commit = measure(path, schema(shipped, edits, extra), page, checkpoint, args)
            print(
                f"{name}: {statement + commit:.1f} CPU-µs per row "
                f"(statement {statement:.1f}, COMMIT {commit:.1f})"
            )


if __name__ == "__main__":
    main()
