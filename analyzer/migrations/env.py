"""Alembic environment: run against the connection that runtime.db.upgrade passes in."""

from alembic import context

from analyzer.tables import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection, target_metadata=metadata, version_table="alembic_version_analyzer"
)
with context.begin_transaction():
    context.run_migrations()
