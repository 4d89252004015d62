"""The record that counts each sealed fragment once per (channel, epoch) (:mod:`analyzer.seen`):
``seen_parts``, one row per folded part with the sorted uint64 record keys of the fragments it
counted, and ``seen_epochs``, per (channel, epoch) the last part number given and a generation
(the row a fold locks first, serializing the epoch's folds across crowds and workers).

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "seen_epochs",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("generation", sa.LargeBinary(16), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    op.create_table(
        "seen_parts",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("keys", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("seen_parts")
    op.drop_table("seen_epochs")
