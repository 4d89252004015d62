"""Add ``batch_parts`` and ``open_batches``: a batch arrives in parts, each stored raw and
acknowledged, then opened in the background.

``receipts`` and ``accumulators`` keep meaning complete batches only; batches accepted whole
before this revision stay as they are (their ``batch_id`` is known, so a repeat is a duplicate).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_parts",
        sa.Column("batch_id", sa.String(32), primary_key=True),
        sa.Column("part", sa.Integer, primary_key=True),
        sa.Column("parts", sa.Integer, nullable=False),
        sa.Column("shuffler_id", sa.String(64), nullable=False),
        sa.Column("channel_id", sa.String(64), nullable=False),
        sa.Column("crowd_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("n_contributions", sa.Integer, nullable=False),
        sa.Column("n_fragments", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=True),
        sa.Column("opened", sa.Boolean, nullable=False),
        sa.Column("invalid", sa.Integer, nullable=False),
        sa.Column("received_at", sa.Float, nullable=False),
    )
    op.create_index("ix_batch_parts_opened", "batch_parts", ["opened"])
    op.create_table(
        "open_batches",
        sa.Column("batch_id", sa.String(32), primary_key=True),
        sa.Column("state", sa.LargeBinary, nullable=False),
        sa.Column("opened", sa.Integer, nullable=False),
        sa.Column("n_fragments", sa.Integer, nullable=False),
        sa.Column("invalid", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("open_batches")
    op.drop_index("ix_batch_parts_opened", "batch_parts")
    op.drop_table("batch_parts")
