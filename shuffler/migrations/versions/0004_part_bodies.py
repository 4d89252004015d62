"""A part's signed body lives in ``part_bodies``, apart from its forwarding state in
``batch_parts``: staging, publishing, leasing and acknowledging a part then update a small
row instead of rewriting a body of up to ~4 MB each time.

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
        "part_bodies",
        sa.Column("batch_id", sa.String(32), primary_key=True),
        sa.Column("part", sa.Integer, primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    op.execute(
        "INSERT INTO part_bodies (batch_id, part, body) "
        "SELECT batch_id, part, body FROM batch_parts"
    )
    with op.batch_alter_table("batch_parts") as batch:
        batch.drop_column("body")


def downgrade() -> None:
    with op.batch_alter_table("batch_parts") as batch:
        batch.add_column(sa.Column("body", sa.LargeBinary, nullable=True))
    op.execute(
        "UPDATE batch_parts SET body = (SELECT b.body FROM part_bodies b "
        "WHERE b.batch_id = batch_parts.batch_id AND b.part = batch_parts.part)"
    )
    with op.batch_alter_table("batch_parts") as batch:
        batch.alter_column("body", existing_type=sa.LargeBinary, nullable=False)
    op.drop_table("part_bodies")
