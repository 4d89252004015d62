"""Migrations that only PostgreSQL sees: batch part bodies stored uncompressed at both parties."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import text

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
