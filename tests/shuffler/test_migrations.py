"""Migrations of the shuffler's schema that only PostgreSQL sees."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy import text

from runtime import db
from shuffler.app import MIGRATIONS


def test_postgresql_stores_part_bodies_uncompressed(postgres_url: str) -> None:
    """0006 makes ``part_bodies.body`` ``EXTERNAL`` (out of line, never compressed); its
    downgrade makes it ``EXTENDED`` again (PostgreSQL's default for ``bytea``)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    engine = db.make_engine(postgres_url)
    storage = text(
        "SELECT a.attstorage FROM pg_attribute a JOIN pg_class c ON a.attrelid = c.oid"
        " WHERE c.relname = 'part_bodies' AND a.attname = 'body'"
    )
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        upgraded = conn.execute(storage).scalar_one()
        command.downgrade(config, "0005")
        downgraded = conn.execute(storage).scalar_one()
    engine.dispose()
    assert (upgraded, downgraded) == ("e", "x")
