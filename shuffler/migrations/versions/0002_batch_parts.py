"""Batches in parts: ``batch_parts`` holds each signed part and its forwarding lease; ``batches``
keeps one row of counts per released group.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_MOVED = ("body", "signature", "attempts", "next_attempt_at", "last_error")
_PART_COLUMNS = (
    "batch_id, part, body, signature, status, created_at, attempts, next_attempt_at, "
    "lease_until, forwarded_at, last_error"
)


def upgrade() -> None:
    op.create_table(
        "batch_parts",
        sa.Column("batch_id", sa.String(32), primary_key=True),
        sa.Column("part", sa.Integer, primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("signature", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("lease_until", sa.Float, nullable=True),
        sa.Column("forwarded_at", sa.Float, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
    )
    op.create_index("ix_batch_parts_due", "batch_parts", ["status", "next_attempt_at"])
    # A batch stored before parts existed is part 0 of 1 (Batch's defaults): its signed bytes
    # are sent unchanged.
    op.execute(
        f"INSERT INTO batch_parts ({_PART_COLUMNS}) SELECT batch_id, 0, body, signature, status, "
        "created_at, attempts, next_attempt_at, NULL, forwarded_at, last_error FROM batches"
    )
    op.drop_index("ix_batches_status", table_name="batches")
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("parts", sa.Integer, nullable=False, server_default="1"))
        for column in _MOVED:
            batch.drop_column(column)


def downgrade() -> None:
    """Back to one row per batch; refused while a batch has more than one part."""
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT count(*) FROM batches WHERE parts > 1")).scalar_one():
        raise RuntimeError("cannot downgrade: batches with several parts are stored")
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("body", sa.LargeBinary, nullable=False, server_default=""))
        batch.add_column(sa.Column("signature", sa.Text, nullable=False, server_default=""))
        batch.add_column(sa.Column("attempts", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("next_attempt_at", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_error", sa.Text, nullable=True))
        batch.drop_column("parts")
    for column in _MOVED:
        op.execute(
            f"UPDATE batches SET {column} = (SELECT p.{column} FROM batch_parts p "
            "WHERE p.batch_id = batches.batch_id AND p.part = 0)"
        )
    op.create_index("ix_batches_status", "batches", ["status", "next_attempt_at"])
    op.drop_table("batch_parts")
