"""PostgreSQL stores a received batch part's signed body without compressing it (``STORAGE
EXTERNAL``), as the shufflers store theirs: a part is ~4 MB of base64 JSON, stored once when it
arrives and read back whole when it is opened, and the server's pglz compression of every part
was the busiest statement of the analyzer's database while an epoch of 10^6 devices arrived.
SQLite is unchanged.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE batch_parts ALTER COLUMN body SET STORAGE EXTERNAL")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE batch_parts ALTER COLUMN body SET STORAGE EXTENDED")
