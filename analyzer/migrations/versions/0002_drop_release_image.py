"""Drop ``releases.image``: the dashboard renders images from the stored summary.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("releases") as batch:
        batch.drop_column("image")


def downgrade() -> None:
    with op.batch_alter_table("releases") as batch:
        batch.add_column(sa.Column("image", sa.LargeBinary, nullable=True))
