"""PostgreSQL stores a batch part's signed body without compressing it (``STORAGE EXTERNAL``):
a part is ~4 MB of base64 JSON, written once when a group closes and read back whole when it
is forwarded, and the server's pglz compression of every part was work on the close's path.
SQLite is unchanged.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE part_bodies ALTER COLUMN body SET STORAGE EXTERNAL")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE part_bodies ALTER COLUMN body SET STORAGE EXTENDED")
