"""Initial analyzer schema.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "receipts",
        sa.Column("batch_id", sa.String(32), primary_key=True),
        sa.Column("shuffler_id", sa.String(64), nullable=False),
        sa.Column("channel_id", sa.String(64), nullable=False, index=True),
        sa.Column("crowd_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("n_contributions", sa.Integer, nullable=False),
        sa.Column("n_fragments", sa.Integer, nullable=False),
        sa.Column("invalid", sa.Integer, nullable=False),
        sa.Column("received_at", sa.Float, nullable=False),
    )
    op.create_table(
        "accumulators",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("crowd_id", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("shuffler_id", sa.String(64), primary_key=True),
        sa.Column("state", sa.LargeBinary, nullable=False),
        sa.Column("batches", sa.Integer, nullable=False),
    )
    op.create_table(
        "releases",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("channel_id", sa.String(64), nullable=False, index=True),
        sa.Column("epoch_from", sa.BigInteger, nullable=False),
        sa.Column("epoch_to", sa.BigInteger, nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("certificate", sa.Text, nullable=False),
        sa.Column("summary", sa.Text, nullable=False),
        sa.Column("image", sa.LargeBinary, nullable=True),
        sa.Column("released_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("releases", "accumulators", "receipts"):
        op.drop_table(table)
