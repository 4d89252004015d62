"""``receipts.n_verified``: the crowd a batch's certificate and estimate rest on, which the
analyzer verifies from the batch's fragments instead of taking the shuffler's word
(:meth:`common.mechanisms.FragmentCount.verified_crowd`); ``receipts.withheld``: the batch's
verified crowd is below its channel's ``min_crowd``, so it never joined an accumulator; an
index on a part's group (shuffler, channel, crowd, epoch), so a second batch for one group is
found at intake; and ``shuffler_descriptors``, the newest signed descriptor of each shuffler,
which every analyzer worker serves.

Receipts of batches folded before this revision stay NULL and count their claimed
``n_contributions`` (what was certified when they arrived).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.add_column(sa.Column("n_verified", sa.Integer, nullable=True))
        batch.add_column(
            sa.Column("withheld", sa.Boolean, nullable=False, server_default=sa.false())
        )
    op.create_index(
        "ix_batch_parts_group",
        "batch_parts",
        ["shuffler_id", "channel_id", "crowd_id", "epoch"],
    )
    op.create_table(
        "shuffler_descriptors",
        sa.Column("shuffler_id", sa.String(64), primary_key=True),
        sa.Column("issued_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Column("document", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("shuffler_descriptors")
    op.drop_index("ix_batch_parts_group", table_name="batch_parts")
    with op.batch_alter_table("receipts") as batch:
        batch.drop_column("withheld")
        batch.drop_column("n_verified")
