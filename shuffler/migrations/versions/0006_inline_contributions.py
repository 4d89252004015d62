"""PostgreSQL keeps a contribution's sealed fragments in its row (``toast_tuple_target`` at its
maximum, 8160 bytes): a typical contribution (2-3 KB sealed) was moved out of line into the
TOAST table, so closing a group read every survivor through the TOAST index, two chunks each.
Contributions larger than that are still stored out of line; SQLite is unchanged.

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
        op.execute("ALTER TABLE contributions SET (toast_tuple_target = 8160)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE contributions RESET (toast_tuple_target)")
