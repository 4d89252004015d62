"""``batch_parts.status`` (``stored``, ``opened``, ``quarantined``), ``attempts`` and
``last_error`` in place of the ``opened`` flag: a part whose opening keeps failing is
quarantined after a bounded number of attempts instead of being retried forever, and an
operator sees which one, how often it failed and why.

Existing rows keep their meaning: opened parts become ``opened``, the others ``stored`` with no
failed attempt.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batch_parts") as batch:
        batch.add_column(
            sa.Column("status", sa.String(16), nullable=False, server_default="stored")
        )
        batch.add_column(sa.Column("attempts", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_error", sa.Text, nullable=True))
    parts = sa.table("batch_parts", sa.column("opened", sa.Boolean), sa.column("status"))
    op.execute(parts.update().where(parts.c.opened.is_(True)).values(status="opened"))
    with op.batch_alter_table("batch_parts") as batch:
        batch.drop_index("ix_batch_parts_opened")
        batch.drop_column("opened")
        batch.create_index("ix_batch_parts_status", ["status"])


def downgrade() -> None:
    with op.batch_alter_table("batch_parts") as batch:
        batch.add_column(sa.Column("opened", sa.Boolean, nullable=False, server_default=sa.false()))
    parts = sa.table("batch_parts", sa.column("opened", sa.Boolean), sa.column("status"))
    op.execute(parts.update().where(parts.c.status == "opened").values(opened=True))
    with op.batch_alter_table("batch_parts") as batch:
        batch.drop_index("ix_batch_parts_status")
        batch.drop_column("last_error")
        batch.drop_column("attempts")
        batch.drop_column("status")
        batch.create_index("ix_batch_parts_opened", ["opened"])
