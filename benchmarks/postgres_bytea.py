"""What PostgreSQL's ``bytea`` handling costs the shuffler: a contribution row stored whole in
its page or moved to TOAST, and rows read as hex text or in the binary format.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/postgres_bytea.py
[--server postgres@127.0.0.1:5432] [--rows N] [--bytes N]``. For each schema, a fresh database
migrated by the shuffler's own migrations (head: rows kept inline, ``toast_tuple_target``; and
0006, PostgreSQL's default), ``--rows`` contributions of ``--bytes`` random bytes of fragments
(2,100: a 30-fragment k-RAPPOR contribution) inserted in transactions of 51 rows, then read
back whole by one server-side cursor as the close reads a group (rows as text, then in the
binary format of :data:`runtime.db.BINARY_RESULTS`). Prints CPU-µs per row of the PostgreSQL
server (every ``postgres`` process) and of this process, for each step.
"""

from __future__ import annotations

import argparse
import os
import secrets
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
from alembic import command
from alembic.config import Config

from runtime import db
from services.tools import loadgen
from shuffler.app import MIGRATIONS
from shuffler.tables import contributions

SCHEMAS = {"rows inline (head)": "head", "PostgreSQL's default (0006)": "0006"}


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
    query = select(c.id, c.fragments).execution_options(**{db.BINARY_RESULTS: binary})
    with engine.connect() as conn:
        streamed = conn.execution_options(stream_results=True, max_row_buffer=2000)
        for rows in streamed.execute(query).partitions(2000):
            assert all(len(row[1]) for row in rows)


def measure(server: str, revision: str, rows: int, size: int) -> dict[str, tuple[float, float]]:
    """Insert, then read as text and as binary, on a fresh database at ``revision``."""
    user, _, hostport = server.partition("@")
    name = f"esa_bench_{secrets.token_hex(4)}"
    with psycopg.connect(f"postgresql://{user}@{hostport}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        engine = db.make_engine(f"postgresql+psycopg://{user}@{hostport}/{name}")
        try:
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            with engine.begin() as conn:
                config.attributes["connection"] = conn
                command.upgrade(config, revision)
            return {
                "insert": cpu_per_row(lambda: fill(engine, rows, size), rows),
                "read as text": cpu_per_row(lambda: read(engine, False), rows),
                "read in binary": cpu_per_row(lambda: read(engine, True), rows),
            }
        finally:
            engine.dispose()
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="postgres@127.0.0.1:5432", help="USER@HOST:PORT")
    parser.add_argument("--rows", type=int, default=100_000, help="contributions per schema")
    parser.add_argument("--bytes", type=int, default=2100, help="fragments bytes per row")
    args = parser.parse_args()
    print(f"{args.rows:,} rows of {args.bytes:,} bytes; CPU-µs per row (server, this process)")
    for label, revision in SCHEMAS.items():
        for step, (server, own) in measure(args.server, revision, args.rows, args.bytes).items():
            print(f"{label}, {step}: server {server:.1f}, this process {own:.1f}")


if __name__ == "__main__":
    main()
