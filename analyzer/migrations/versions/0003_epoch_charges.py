"""Add ``epoch_charges``: the privacy ledger charged once per (channel, crowd, epoch).

Releases no longer charge privacy (a GET is a read; ``releases`` keeps what was published).
Epochs received before this revision are charged at the analyzer's next start
(:meth:`analyzer.ledger.LedgerService.charge_missing`).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "epoch_charges",
        sa.Column("channel_id", sa.String(64), primary_key=True),
        sa.Column("crowd_id", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("certificate", sa.Text, nullable=False),
        sa.Column("batches", sa.Integer, nullable=False),
        sa.Column("charged_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("epoch_charges")
