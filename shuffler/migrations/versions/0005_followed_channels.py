"""``followed_channels``: the channel policies this shuffler adopted from the analyzer's signed
collection config while running (channels added or retired without a restart), so a restart
or a replica serves them before the next fetch; ``version`` is the config version adopted.
``followed_keys``: the analyzer signing key the shuffler moved to along the analyzer's key
successions, so a restart or a replica refuses a fork made later with an older key.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "followed_channels",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
    )
    op.create_table(
        "followed_keys",
        sa.Column("party", sa.String(80), primary_key=True),
        sa.Column("signing_key", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("followed_keys")
    op.drop_table("followed_channels")
