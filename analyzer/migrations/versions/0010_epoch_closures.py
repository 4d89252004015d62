"""``epoch_closures``: the (channel, crowd, epoch) groups closed for good at their timeout,
with the shufflers whose batches their releases rest on.

An epoch is released only when every shuffler serving the channel has delivered its batch or
the epoch was closed here, ``epoch_close_seconds`` after its end; batches that complete after
the closure never enter its releases (a release changes by whole epochs, never by one
shuffler's batch: docs/protocol-notes.md, "Releases wait for every shuffler").

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "epoch_closures",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("crowd_id", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("shufflers", sa.Text, nullable=False),
        sa.Column("closed_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("epoch_closures")
