"""Initial shuffler schema.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "contributions",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("channel_id", sa.String(64), nullable=False),
        sa.Column("crowd_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("client_id", sa.String(64), nullable=False),
        sa.Column("nonce", sa.LargeBinary(16), nullable=False, unique=True),
        sa.Column("fragments", sa.LargeBinary, nullable=False),
        sa.Column("n_fragments", sa.Integer, nullable=False),
        sa.Column("received_at", sa.Float, nullable=False),
        sa.Column("held_part", sa.Integer, nullable=True),
        sa.Column("receipt", sa.String(32), nullable=False, unique=True),
        sa.UniqueConstraint(
            "client_id", "channel_id", "crowd_id", "epoch", name="uq_contribution_quota"
        ),
    )
    op.create_index(
        "ix_contributions_group", "contributions", ["channel_id", "crowd_id", "epoch", "held_part"]
    )
    op.create_table(
        "groups",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("crowd_id", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("part", sa.Integer, primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("kept", sa.Integer, nullable=False),
        sa.Column("deleted", sa.Integer, nullable=False),
        sa.Column("evaluated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "batches",
        sa.Column("batch_id", sa.String(32), primary_key=True),
        sa.Column("channel_id", sa.String(64), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("n_contributions", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("signature", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("forwarded_at", sa.Float, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
    )
    op.create_index("ix_batches_status", "batches", ["status", "next_attempt_at"])
    op.create_table(
        "purges",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("contributions", sa.Integer, nullable=False),
        sa.Column("purged_at", sa.Float, nullable=False),
    )
    op.create_table(
        "closed_epochs",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("closed_at", sa.Float, nullable=False),
    )
    op.create_table(
        "revoked",
        sa.Column("client_id", sa.String(64), primary_key=True),
        sa.Column("revoked_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("revoked", "closed_epochs", "purges", "batches", "groups", "contributions"):
        op.drop_table(table)
