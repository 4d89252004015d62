"""What the store benchmarks share: the group commit's size under load, and a SQLite file set
up as a shuffler sets up its own (the store's pragmas, then the migrations)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine

from runtime.db import make_engine, upgrade
from shuffler.app import MIGRATIONS
from shuffler.store import ContributionStore
from shuffler.store_backends import make_store

#: Rows per group-commit transaction: what ``strace -c`` counted per ``fdatasync`` at a
#: shuffler under ingest_cpu.py's load.
COMMIT_ROWS = 51


def migrated_sqlite(path: Path) -> tuple[Engine, ContributionStore]:
    """An engine and store on a new SQLite file at ``path``, migrated to head."""
    engine = make_engine(f"sqlite:///{path}")
    store = make_store(engine)  # before the first connection: its pragmas apply to all
    upgrade(engine, MIGRATIONS)
    return engine, store
