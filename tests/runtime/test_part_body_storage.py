"""What only PostgreSQL sees: batch part bodies stored uncompressed at both parties, and rows
read in the binary format where a statement asks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import LargeBinary, event, literal, select, text

from analyzer.service import MIGRATIONS as ANALYZER_MIGRATIONS
from runtime import db
from shuffler.app import MIGRATIONS as SHUFFLER_MIGRATIONS


@pytest.mark.parametrize(
    ("migrations", "table", "before"),
    [(SHUFFLER_MIGRATIONS, "part_bodies", "0005"), (ANALYZER_MIGRATIONS, "batch_parts", "0008")],
    ids=["shuffler", "analyzer"],
)
def test_postgresql_stores_part_bodies_uncompressed(
    postgres_url: str, migrations: Path, table: str, before: str
) -> None:
    """The migration after ``before`` makes ``<table>.body`` ``EXTERNAL`` (out of line, never
    compressed); its downgrade makes it ``EXTENDED`` again (PostgreSQL's default for
    ``bytea``)."""
    config = Config()
    config.set_main_option("script_location", str(migrations))
    engine = db.make_engine(postgres_url)
    storage = text(
        "SELECT a.attstorage FROM pg_attribute a JOIN pg_class c ON a.attrelid = c.oid"
        " WHERE c.relname = :table AND a.attname = 'body'"
    )
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        upgraded = conn.execute(storage, {"table": table}).scalar_one()
        command.downgrade(config, before)
        downgraded = conn.execute(storage, {"table": table}).scalar_one()
    engine.dispose()
    assert (upgraded, downgraded) == ("e", "x")


def test_binary_results_only_for_the_statement_that_asks(postgres_url: str) -> None:
    """:data:`runtime.db.BINARY_RESULTS` makes PostgreSQL send that statement's rows in the
    binary format (bytes equal to what was stored), and the next statement on the same
    connection is text again."""
    engine = db.make_engine(postgres_url)
    formats: list[int] = []

    @event.listens_for(engine, "after_cursor_execute")
    def _format(conn: Any, cursor: Any, *_: Any) -> None:
        formats.append(cursor.pgresult.fformat(0))

    stored = os.urandom(3000)
    query = select(literal(stored, LargeBinary))
    with engine.connect() as conn:
        binary = conn.execute(query.execution_options(**{db.BINARY_RESULTS: True})).scalar_one()
        plain = conn.execute(query).scalar_one()
    engine.dispose()
    assert binary == plain == stored
    assert formats == [1, 0]  # libpq: 1 binary, 0 text
