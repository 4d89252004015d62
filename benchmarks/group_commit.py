"""The shuffler's group commit on PostgreSQL, alone: CPU of the writer thread per transaction and
per row, and the wall time per transaction, for batches of 1 to 28 contributions
(docs/benchmarks.md, "Group commit on PostgreSQL").

Each batch goes through :meth:`shuffler.store_backends.PostgresContributionStore.insert`, the
writer's call (one ``_PG_INSERT`` statement in autocommit). ``--text`` sends the nine array
parameters in PostgreSQL's text format instead of the binary one the store uses (``%s`` for
``%b``), to compare: the text format hex-encodes every bytea and escapes every element with a
regular expression in the client. A contribution has ``--fragments`` sealed fragments of
``--bytes`` bytes each. Run: ``.venv/bin/python benchmarks/group_commit.py [--text]``; PostgreSQL at
``ESA_BENCH_POSTGRES`` (default ``postgres@127.0.0.1:5432``); the script creates and drops the
database ``esa_group_commit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.envelope import Contribution
from runtime import db
from shuffler import store, store_backends, tables
from shuffler.records import Pending

POSTGRES = os.environ.get("ESA_BENCH_POSTGRES", "postgres@127.0.0.1:5432")
DATABASE = "esa_group_commit"
SIZES = (1, 4, 13, 28)


def admin(statement: str) -> None:
    """Run ``statement`` (CREATE/DROP DATABASE) on the server's ``postgres`` database."""
    user, hostport = POSTGRES.split("@")
    host, port = hostport.split(":")
    with psycopg.connect(host=host, port=port, user=user, dbname="postgres", autocommit=True) as c:
        c.execute(statement)


def batches(size: int, count: int, start: int, args: argparse.Namespace) -> list[list[Pending]]:
    """``count`` batches of ``size`` distinct clients' contributions (fresh nonces)."""
    fragments = tuple(os.urandom(args.bytes) for _ in range(args.fragments))
    return [
        [
            Pending(
                f"client{start + b * size + i:012d}",
                Contribution(
                    channel_id="homepage",
                    crowd_id="default",
                    epoch=1_000,
                    nonce=os.urandom(16),
                    fragments=fragments,
                ),
                time.time(),
            )
            for i in range(size)
        ]
        for b in range(count)
    ]


def measure(target: store.ContributionStore, args: argparse.Namespace) -> None:
    """Insert ``--rows`` rows per batch size in :data:`SIZES` (at least 40 transactions each)
    and print the writer's CPU per transaction and per row and the wall time per transaction;
    every batch holds new clients and nonces, so no row is refused."""
    start = 0
    for size in SIZES:
        count = max(40, args.rows // size)
        work = batches(size, count, start, args)
        start += size * count
        cpu, wall = time.thread_time(), time.perf_counter()
        for batch in work:
            target.insert(batch)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        print(
            f"batch {size:2d}: CPU {cpu * 1e3 / count:.3f} ms per transaction, "
            f"{cpu * 1e3 / count / size:.3f} ms per row; wall {wall * 1e3 / count:.3f} ms "
            "per transaction"
        )


def main() -> None:
    """Parse the options, create the database with the shuffler's tables, measure, drop it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", action="store_true", help="array parameters as text")
    parser.add_argument("--fragments", type=int, default=31, help="fragments per contribution")
    parser.add_argument("--bytes", type=int, default=20, help="bytes per sealed fragment")
    parser.add_argument("--rows", type=int, default=3_000, help="rows per batch size")
    args = parser.parse_args()
    if args.text:
        store_backends._PG_INSERT = store_backends._PG_INSERT.replace("%b", "%s")
    admin(f"DROP DATABASE IF EXISTS {DATABASE}")
    admin(f"CREATE DATABASE {DATABASE}")
    user, hostport = POSTGRES.split("@")
    engine = db.make_engine(f"postgresql+psycopg://{user}@{hostport}/{DATABASE}")
    try:
        tables.metadata.create_all(engine)
        target = store_backends.make_store(engine)
        measure(target, args)
        target.close()
    finally:
        engine.dispose()
        admin(f"DROP DATABASE IF EXISTS {DATABASE}")


if __name__ == "__main__":
    main()
