"""Migrations of the shuffler's schema that only PostgreSQL sees."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy import text

from runtime import db
from shuffler.app import MIGRATIONS


def test_postgresql_keeps_a_contributions_fragments_in_its_row(postgres_url: str) -> None:
    """0006 sets ``toast_tuple_target`` to its maximum (a 2-3 KB contribution was moved out of
    line, and every close read it back through the TOAST index); its downgrade resets it."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    engine = db.make_engine(postgres_url)
    options = text("SELECT reloptions FROM pg_class WHERE relname = 'contributions'")
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        upgraded = conn.execute(options).scalar_one()
        command.downgrade(config, "0005")
        downgraded = conn.execute(options).scalar_one()
    engine.dispose()
    assert upgraded == ["toast_tuple_target=8160"] and not downgraded
