"""``channel_changes``: the channels added and retired while the analyzer runs, as a log.

Each row is one change (``add`` with the channel's config, or ``retire`` with the first epoch
it no longer takes); its ``version`` numbers the collection configs (monotonic), and every
analyzer replica folds the log into its channel table (docs/operations.md).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "channel_changes",
        sa.Column("version", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("channel_id", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("config", sa.Text, nullable=True),
        sa.Column("retired_from_epoch", sa.BigInteger, nullable=True),
        sa.Column("changed_at", sa.Float, nullable=False),
    )
    op.create_index("ix_channel_changes_channel", "channel_changes", ["channel_id"])


def downgrade() -> None:
    op.drop_index("ix_channel_changes_channel", table_name="channel_changes")
    op.drop_table("channel_changes")
