"""What reading ``bytea`` rows costs the PostgreSQL server and the reader: as hex text (psycopg's
default) or in the binary format (:data:`runtime.db.BINARY_RESULTS`).

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/postgres_bytea.py
[--server postgres@127.0.0.1:5432] [--rows N] [--bytes N] [--repeats N]``. A fresh database
migrated by the shuffler's own migrations gets ``--rows`` contributions of ``--bytes`` random
bytes of fragments (2,100: a 30-fragment k-RAPPOR contribution) in transactions of 51 rows,
then ``VACUUM``, ``CHECKPOINT`` and one untimed scan, so no timed read sets hint bits or
writes pages back. Then the rows are read whole by one server-side cursor, as the close reads
a group, ``--repeats`` times in each format, alternating. Prints the median CPU-µs per row of
the PostgreSQL server (every ``postgres`` process on the machine) and of this process, with
the range.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from sqlalchemy import insert, select
from sqlalchemy.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _store import COMMIT_ROWS

from runtime import db
from services.tools import loadgen
from shuffler.app import MIGRATIONS
from shuffler.tables import contributions


def cpu_per_row(step: Callable[[], None], rows: int) -> tuple[float, float]:
    """CPU-µs per row of the PostgreSQL server and of this process while ``step`` runs."""
    server, own = loadgen.server_cpu_seconds("postgres"), time.process_time()
    step()
    server = loadgen.server_cpu_seconds("postgres") - server
    return 1e6 * server / rows, 1e6 * (time.process_time() - own) / rows


def fill(engine: Engine, rows: int, size: int) -> None:
    """``rows`` contributions of one group, ``size`` random bytes of fragments each."""
    for start in range(0, rows, COMMIT_ROWS):
        batch = [
            {
                "channel_id": "homepage",
                "crowd_id": "all",
                "epoch": 1,
                "client_id": secrets.token_hex(16),
                "nonce": os.urandom(16),
                "fragments": os.urandom(size),
                "n_fragments": 30,
                "received_at": 0.0,
                "receipt": secrets.token_hex(16),
            }
            for _ in range(min(COMMIT_ROWS, rows - start))
        ]
        with engine.begin() as conn:
            conn.execute(insert(contributions), batch)


def read(engine: Engine, binary: bool) -> None:
    """Every row's id and fragments through one server-side cursor (the close's read)."""
    c = contributions.c
    query = select(c.id, c.fragments)
    query = db.binary_rows(query) if binary else query
    with engine.connect() as conn:
        streamed = conn.execution_options(stream_results=True, max_row_buffer=2000)
        for rows in streamed.execute(query).partitions(2000):
            if not all(row[1] for row in rows):
                raise RuntimeError("a row came back without its fragments")


def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Fill a fresh database, settle it, then time the reads in both formats, alternating."""
    user, _, hostport = args.server.partition("@")
    name = f"esa_bench_{secrets.token_hex(4)}"
    with psycopg.connect(f"postgresql://{user}@{hostport}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        engine = db.make_engine(f"postgresql+psycopg://{user}@{hostport}/{name}")
        try:
            db.upgrade(engine, MIGRATIONS)
            fill(engine, args.rows, args.bytes)
            with engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                conn.exec_driver_sql("VACUUM contributions")
                conn.exec_driver_sql("CHECKPOINT")
            read(engine, True)
            found: dict[str, list[tuple[float, float]]] = {"text": [], "binary": []}
            for _ in range(args.repeats):
                for label in found:
                    step = functools.partial(read, engine, label == "binary")
                    found[label].append(cpu_per_row(step, args.rows))
            return found
        finally:
            engine.dispose()
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="postgres@127.0.0.1:5432", help="USER@HOST:PORT")
    parser.add_argument("--rows", type=int, default=100_000, help="contributions stored")
    parser.add_argument("--bytes", type=int, default=2100, help="fragments bytes per row")
    parser.add_argument("--repeats", type=int, default=5, help="reads in each format")
    args = parser.parse_args()
    print(f"{args.rows:,} rows of {args.bytes:,} bytes; CPU-µs per row, median (range)")
    for label, samples in measure(args).items():
        server, own = ([sample[i] for sample in samples] for i in (0, 1))
        print(
            f"rows as {label}: server {statistics.median(server):.1f} "
            f"({min(server):.1f}-{max(server):.1f}), this process "
            f"{statistics.median(own):.1f} ({min(own):.1f}-{max(own):.1f})"
        )


if __name__ == "__main__":
    main()
